"""What a stream delivered, as the output of a response that failed mid-stream (lmsp_core.store.tasks.delivered).
The end-to-end checks fail real generations: tests/e2e/test_outages.py (time limit) and
tests/e2e/test_reclaim.py (workers lost)."""

from typing import Any

import msgspec

from lmsp_core import wire
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.delivered import DeliveredOutput
from lmsp_core.store.tasks.eventlog import Event
from workers.writer import joined

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


def test_log_probabilities_of_the_deltas_stay_with_their_message() -> None:
    """A message's deltas' entries, stored and folded again, are its part's (and what a resumed run
    starts from); a writer joining two deltas joins their entries."""
    first, second = (wire.TokenLogprob(token=text, logprob=-1.0, bytes=list(text.encode()), top_logprobs=[])
                     for text in ("Hel", "lo"))
    hel = wire.OutputTextDelta(response_id=RID, item_id="msg_1", delta="Hel", logprobs=[first])
    lo = wire.OutputTextDelta(response_id=RID, item_id="msg_1", delta="lo", logprobs=[second])
    assert joined(hel, lo) == wire.OutputTextDelta(response_id=RID, item_id="msg_1", delta="Hello",
                                                   logprobs=[first, second])
    plain = wire.OutputTextDelta(response_id=RID, item_id="msg_1", delta="!")
    assert joined(plain, plain).logprobs is msgspec.UNSET
    log = [*events()[:-2], (wire.TEXT_DELTA, hel), (wire.TEXT_DELTA, lo)]
    stored = [Event(i + 1, name, wire.encoder.encode(data)) for i, (name, data) in enumerate(log)]
    folded = DeliveredOutput()
    folded.add_stored(stored)
    assert folded.logprobs("msg_1") == [first, second] and folded.logprobs("rs_1") == []
    message = folded.items()[-1]
    assert isinstance(message, wire.OutputMessage) and message.content[0].logprobs == [first, second]
