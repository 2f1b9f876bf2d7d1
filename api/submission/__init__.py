"""Turning a request into a queued task: the checks before anything is stored, in one call
(``admission``), the task record and its job (``submit``), and ``Idempotency-Key``
(``idempotency``)."""
