"""``lmsp models``: the models, whether workers serve them, and what they can do."""

from lmsp.client import Client, LmspClientError
from lmsp.clientcommands import terminal


def models(client: Client) -> int:
    try:
        listed = client.models.list()
    except LmspClientError as exc:
        return terminal.report(exc)
    rows = [["MODEL", "STATUS", "WORKERS", "CONTEXT", "MAX OUTPUT", "CAPABILITIES"]]
    for model in listed.data:
        rows.append([model.id, model.status, str(model.workers), str(model.context_window),
                     str(model.max_output_tokens), ",".join(model.capabilities)])
    terminal.table(rows)
    return 0
