"""Every response object the ``/v1`` rendering makes of a task, its body and the ``response`` of each
lifecycle event, whichever way the task ends, has the fields Open Responses' ``ResponseResource``
requires (tests/e2e/test_open_responses.py checks them over HTTP for the ends a tiny model reaches)."""

from typing import Any

import msgspec
import pytest

from api.openai import objects as oa
from api.openai.rendering import ResponseView, render_all, response_object
from lmsp_core import wire
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.records import Kind, TaskRecord
from lmsp_core.wire.errors import problem
from lmsp_core.wire.extensions import LOGPROBS
from tests.support import RESPONSE_RESOURCE

RESPONSE_ID = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
USAGE = wire.Usage(input_tokens=3, output_tokens=2, total_tokens=5)
ENDS: dict[str, tuple[str, Any]] = {
    "completed": (wire.COMPLETED, wire.ResponseCompleted(response_id=RESPONSE_ID, status="completed", usage=USAGE)),
    "incomplete": (wire.INCOMPLETE, wire.ResponseIncomplete(
        response_id=RESPONSE_ID, status="incomplete", usage=USAGE,
        incomplete_details=wire.IncompleteDetails(reason="max_output_tokens"))),
    "failed": (wire.FAILED, wire.ResponseFailed(response_id=RESPONSE_ID, status="failed",
                                                error=problem(500, "worker_lost", "Worker lost", "It died."))),
    "cancelled": (wire.CANCELLED, wire.ResponseCancelled(response_id=RESPONSE_ID, status="cancelled")),
}


def _record(kind: Kind, extensions: dict[str, Any] | None = None) -> TaskRecord:
    request = wire.ResponseRequest(model="tiny-random", input=[wire.Message(
        role="user", content=[wire.InputText(text="Hi")])], store=True, extensions=extensions)
    return TaskRecord(id="task_01J8M6Q4W2T7N5R3V9X1Z8B0DF", model="tiny-random", owner="local", kind=kind,
                      status="queued", created_at=1794200000, response_id=RESPONSE_ID,
                      request=wire.encoder.encode(request))


def _fields(response: oa.Response) -> dict[str, Any]:
    encoded: dict[str, Any] = msgspec.json.decode(oa.encoder.encode(response))
    assert set(encoded) >= RESPONSE_RESOURCE, sorted(RESPONSE_RESOURCE - set(encoded))
    return encoded


@pytest.mark.parametrize("end", list(ENDS))
@pytest.mark.parametrize("kind", ["direct", "task"])
def test_every_lifecycle_event_has_a_whole_response(end: str, kind: Kind) -> None:
    log = [eventlog.Event(1, wire.CREATED, wire.encoder.encode(wire.ResponseCreated(response_id=RESPONSE_ID))),
           eventlog.Event(2, ENDS[end][0], wire.encoder.encode(ENDS[end][1]))]
    events = render_all(ResponseView(_record(kind)), log)
    with_response = [event for event in events if hasattr(event, "response")]
    assert len(with_response) == 3  # created, in progress, the end
    for event in with_response:
        fields = _fields(event.response)
        assert (fields["presence_penalty"], fields["frequency_penalty"], fields["top_logprobs"]) == (0, 0, 0)
        assert fields["reasoning"] is None and fields["max_tool_calls"] is None


def test_the_body_echoes_top_logprobs() -> None:
    view = ResponseView(_record("task", {LOGPROBS: 3}))
    assert _fields(response_object(view))["top_logprobs"] == 3
