"""Deleting a stored response: ``DELETE /lmsp/v1/responses/{id}`` and ``DELETE /v1/responses/{id}``.

What goes is the stored turn: its input, its response and the id that finds them, so the response
can no longer be retrieved, listed (``input_items``) or continued with ``previous_response_id``, nor
a conversation through it. A response that is not final yet is cancelled first (its generation stops
within a few tokens; a client following it sees it end ``cancelled``), as nobody could read its end.
The task of a background response keeps its record and events (``/lmsp/v1/tasks``) until they expire.
"""

from api.process import Services
from lmsp_core import wire
from lmsp_core.wire import ids
from lmsp_core.wire.errors import NotFound


async def delete_stored(services: Services, response_id: str, owner: str) -> wire.DeletedResponse:
    """Delete the owner's stored response; ``404 response_not_found`` for any other id."""
    if not ids.is_id(response_id, ids.RESPONSE):
        raise NotFound(f"Response {response_id!r} does not exist.", code="response_not_found")
    turn = await services.conversations.load(response_id, owner)
    record = await services.store.get(turn.task_id)
    if record is not None and record.owner == owner and not record.final:
        await services.store.cancel(record)
    await services.conversations.delete(turn)
    return wire.DeletedResponse(id=response_id)
