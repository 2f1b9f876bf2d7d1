"""What a stream delivered, as the output of a response that failed mid-stream (lmsp_core.store.delivered).
The end-to-end checks fail real generations: tests/e2e/test_outages.py (time limit) and
tests/e2e/test_reclaim.py (workers lost)."""

from typing import Any

import msgspec

from lmsp_core import wire
from lmsp_core.store import eventlog
from lmsp_core.store.delivered import DeliveredOutput
from lmsp_core.store.eventlog import Event

RID = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"


def events() -> list[tuple[str, Any]]:
    """A reasoning item (finished), a function call (finished) and a message cut short."""
    reasoning = wire.OutputReasoning(id="rs_1")
    done_reasoning = wire.OutputReasoning(id="rs_1", summary=[wire.SummaryTextPart(text="Think.")])
    call = wire.OutputFunctionCall(id="fc_1", call_id="call_1", name="f", arguments="{}")
    return [
        (wire.CREATED, wire.ResponseCreated(response_id=RID)),
        (wire.ITEM_ADDED, wire.OutputItemAdded(response_id=RID, output_index=0, item=reasoning)),
        (wire.REASONING_DELTA, wire.ReasoningSummaryTextDelta(response_id=RID, item_id="rs_1", delta="Think.")),
        (wire.ITEM_DONE, wire.OutputItemDone(response_id=RID, output_index=0, item=done_reasoning)),
        (wire.ITEM_ADDED, wire.OutputItemAdded(response_id=RID, output_index=1,
                                               item=wire.OutputFunctionCall(id="fc_1", call_id="call_1", name="f",
                                                                            arguments=""))),
        (wire.ITEM_DONE, wire.OutputItemDone(response_id=RID, output_index=1, item=call)),
        (wire.ITEM_ADDED, wire.OutputItemAdded(response_id=RID, output_index=2, item=wire.OutputMessage(id="msg_1"))),
        (wire.TEXT_DELTA, wire.OutputTextDelta(response_id=RID, item_id="msg_1", delta="Hel")),
        (wire.TEXT_DELTA, wire.OutputTextDelta(response_id=RID, item_id="msg_1", delta="lo")),
    ]


EXPECTED = [
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Think."}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}"},
    {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}],
     "status": "incomplete"},
]


def builtins(items: list[wire.OutputItem]) -> Any:
    return msgspec.json.decode(wire.encoder.encode(items))


def test_finished_items_stay_as_done_and_an_unfinished_one_is_incomplete_with_its_text() -> None:
    fold = DeliveredOutput()
    for name, data in events():
        fold.add(name, data)
    assert builtins(fold.items()) == EXPECTED


def test_the_stored_log_folds_the_same() -> None:
    stored = []
    for number, (name, data) in enumerate(events(), start=1):
        code, packed = eventlog.pack(name, wire.encoder.encode(data), RID)
        stored.append(Event(number, *eventlog.unpack(code.encode(), packed, RID)))
    fold = DeliveredOutput()
    fold.add_stored(stored)
    assert builtins(fold.items()) == EXPECTED


def test_an_open_reasoning_item_and_nothing_at_all() -> None:
    assert DeliveredOutput().items() == []
    fold = DeliveredOutput()
    fold.add(wire.ITEM_ADDED, wire.OutputItemAdded(response_id=RID, output_index=0,
                                                   item=wire.OutputReasoning(id="rs_1")))
    assert builtins(fold.items()) == [{"type": "reasoning", "id": "rs_1", "summary": [], "status": "incomplete"}]
    fold.add(wire.REASONING_DELTA, wire.ReasoningSummaryTextDelta(response_id=RID, item_id="rs_1", delta="Hm"))
    assert builtins(fold.items())[0]["summary"] == [{"type": "summary_text", "text": "Hm"}]
