"""Turning a request into a queued task: the checks before anything is stored, in one call
(``admission``), the task record and its job (``submit``), ``Idempotency-Key`` (``idempotency``),
and the model's prompt renderer and tokenizers that the checks count with (``modeltext``)."""
