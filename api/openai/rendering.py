"""A task as an OpenAI response: the response object, and its stream events rendered from the task's
stored event log (one log, two renderings).

Sequence numbers (docs/protocol.md, "OpenAI compatibility"): the rendering of a log always starts
with ``response.created`` (number 0, from the task record), then each stored event, in order,
becomes a fixed list of OpenAI events (``response.output_item.added`` becomes it and a
``response.content_part.added``, a text delta becomes one ``response.output_text.delta``, ...),
numbered on from there. The rendering of stored event n depends only on events 1..n, so every
reading of a log numbers it the same way, and ``starting_after=N`` is the rendering from the start
with the events numbered up to N left out: gapless and duplicate-free, whenever and wherever it is read.
"""

from collections.abc import Sequence
from typing import Any

import msgspec

from api.openai import objects as oa
from api.openai.translation import echo_of, tier_of
from lmsp_core import wire
from lmsp_core.requests.chat import message_text
from lmsp_core.store.tasks.eventlog import Event
from lmsp_core.store.tasks.records import TaskRecord

FORMAT_TEXT = oa.TextConfig(format=oa.TextFormat())


class ResponseView:
    """The parts of a task's response object that come from its request and record."""

    def __init__(self, record: TaskRecord) -> None:
        self.record = record
        self.request = msgspec.json.decode(record.request, type=wire.ResponseRequest)
        self.background = record.kind == "task"
        self.options = self.request.known_extensions

    def response(self, status: oa.ResponseStatus, output: list[oa.OutputItem], *, usage: oa.Usage | None = None,
                 error: oa.ResponseError | None = None, incomplete: oa.IncompleteDetails | None = None,
                 completed_at: int | None = None) -> oa.Response:
        request = self.request
        return oa.Response(
            id=self.record.response_id, created_at=int(self.record.created_at), status=status,
            completed_at=completed_at, model=self.record.model, output=output, usage=usage, error=error,
            incomplete_details=incomplete, instructions=self._instructions(),
            temperature=request.temperature or 0.0,
            top_p=request.known_extensions.top_p or 1.0, top_logprobs=self.options.logprobs or 0,
            tool_choice=_tool_choice(request.tool_choice), tools=[_tool(tool) for tool in request.tools or ()],
            text=self._text(), max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id or echo_of(request).get("previous_response_id"),
            background=self.background, store=request.store,
            conversation=_conversation(echo_of(request).get("conversation")),
            metadata=self.options.metadata or {}, parallel_tool_calls=self.options.parallel_tool_calls,
            service_tier=tier_of(request), prompt_cache_key=self.options.prompt_cache_key,
            user=echo_of(request).get("user"), safety_identifier=echo_of(request).get("safety_identifier"),
        )

    def _instructions(self) -> str | None:
        first = self.request.input[0]
        if echo_of(self.request).get("instructions") and isinstance(first, wire.Message):
            return message_text(first.content)
        return None

    def _text(self) -> oa.TextConfig:
        chosen = self.request.response_format
        if not isinstance(chosen, wire.JsonSchemaFormat):
            return FORMAT_TEXT
        if echo_of(self.request).get("format") == "json_object":
            return oa.TextConfig(format=oa.JsonObjectFormat())
        spec = chosen.json_schema
        return oa.TextConfig(format=oa.JsonSchemaFormat(name=spec.name, schema=spec.schema,
                                                        description=spec.description, strict=spec.strict))


def _conversation(conversation_id: str | None) -> oa.ConversationRef | msgspec.UnsetType:
    return msgspec.UNSET if conversation_id is None else oa.ConversationRef(id=conversation_id)


def _tool(tool: wire.FunctionTool) -> oa.FunctionTool:
    return oa.FunctionTool(name=tool.name, description=tool.description or None, parameters=tool.parameters,
                           strict=tool.strict)


def _tool_choice(choice: wire.ToolChoice | None) -> Any:
    if isinstance(choice, wire.NamedToolChoice):
        return oa.NamedFunction(name=choice.name)
    return choice or "auto"


# --- the response object from the record -------------------------------------------------------------


def response_object(view: ResponseView, record: TaskRecord | None = None,
                    stored: wire.Response | None = None) -> oa.Response:
    """The response object of ``GET /v1/responses/{id}`` and of non-streamed answers: the final
    response once there is one, else ``queued`` / ``in_progress`` without output."""
    record = record or view.record
    final = stored or record.response_object()
    if final is None:
        status: oa.ResponseStatus = record.status if record.status in ("queued", "in_progress") else "in_progress"
        return view.response(status, [])
    finished = record.finished_at if record.final else None
    return view.response(
        final.status, [output_item(item, stored_status(item)) for item in final.output], usage=usage(final.usage),
        error=response_error(final.error), completed_at=None if finished is None else int(finished),
        incomplete=oa.IncompleteDetails(reason=final.incomplete_details.reason) if final.incomplete_details else None,
    )


def stored_status(item: wire.OutputItem) -> oa.ItemStatus:
    """A final response's item is ``completed`` unless a failure cut it short (``incomplete``)."""
    return "completed" if isinstance(item.status, msgspec.UnsetType) else item.status


def output_item(item: wire.OutputItem, status: oa.ItemStatus) -> oa.OutputItem:
    if isinstance(item, wire.OutputMessage):
        content = [oa.OutputText(text=part.text, logprobs=part.logprobs or []) for part in item.content]
        return oa.Message(id=item.id, status=status, content=content)
    if isinstance(item, wire.OutputFunctionCall):
        return oa.FunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments=item.arguments,
                               status=status)
    return oa.Reasoning(id=item.id, summary=[oa.SummaryText(text=part.text) for part in item.summary], status=status)


def usage(value: wire.Usage | None) -> oa.Usage | None:
    if value is None:
        return None
    details, cached = value.output_tokens_details, value.input_tokens_details
    return oa.Usage(input_tokens=value.input_tokens, output_tokens=value.output_tokens, total_tokens=value.total_tokens,
                    input_tokens_details=oa.InputTokensDetails(cached_tokens=cached.cached_tokens if cached else 0),
                    output_tokens_details=oa.OutputTokensDetails(reasoning_tokens=details.reasoning_tokens if details
                                                                 else 0))


def response_error(problem: wire.Problem | None) -> oa.ResponseError | None:
    if problem is None:
        return None
    return oa.ResponseError(code="server_error" if problem.status >= 500 else "invalid_prompt",
                            message=problem.detail, type=problem.code)


# --- stream events from the log ----------------------------------------------------------------------


class EventRenderer:
    """Renders one task's log, from its first event, as OpenAI stream events (see the module doc)."""

    def __init__(self, view: ResponseView) -> None:
        self.view = view
        self.next_number = 0
        self._items: dict[int, oa.OutputItem] = {}  # by output index: as announced, then as done
        self._done: set[int] = set()
        self._index: dict[str, int] = {}  # item id -> output index
        self._texts: dict[str, list[str]] = {}  # item id -> its deltas so far
        self._summaries: set[str] = set()  # reasoning items whose summary part is open

    def _number(self) -> int:
        self.next_number += 1
        return self.next_number - 1

    def opening(self) -> list[oa.StreamEvent]:
        """Number 0: the response as created (``queued`` in the background, else ``in_progress``)."""
        status: oa.ResponseStatus = "queued" if self.view.background else "in_progress"
        return [oa.ResponseCreated(sequence_number=self._number(), response=self.view.response(status, []))]

    def render(self, event: Event) -> list[oa.StreamEvent]:
        name = event.name
        if name == wire.CREATED:
            return [oa.ResponseInProgress(sequence_number=self._number(),
                                          response=self.view.response("in_progress", []))]
        if name == wire.ITEM_ADDED:
            added = msgspec.json.decode(event.data, type=wire.OutputItemAdded)
            return self._added(added.item, added.output_index)
        if name == wire.TEXT_DELTA:
            delta = msgspec.json.decode(event.data, type=wire.OutputTextDelta)
            self._texts.setdefault(delta.item_id, []).append(delta.delta)
            return [oa.OutputTextDelta(sequence_number=self._number(), item_id=delta.item_id,
                                       output_index=self._index[delta.item_id], content_index=0, delta=delta.delta,
                                       logprobs=delta.logprobs or [])]
        if name == wire.REASONING_DELTA:
            return self._reasoning_delta(msgspec.json.decode(event.data, type=wire.ReasoningSummaryTextDelta))
        if name == wire.ITEM_DONE:
            done = msgspec.json.decode(event.data, type=wire.OutputItemDone)
            return self._item_done(done.item, done.output_index)
        if name in wire.FINAL_EVENTS:
            return [self._final(name, event.data)]
        return []  # an event this rendering does not know: nothing to show

    def _added(self, item: wire.OutputItem, index: int) -> list[oa.StreamEvent]:
        self._index[item.id] = index
        announced = output_item(item, "in_progress")
        if isinstance(announced, oa.Message):
            announced = msgspec.structs.replace(announced, content=[])
        self._items[index] = announced
        events: list[oa.StreamEvent] = [oa.OutputItemAdded(sequence_number=self._number(), output_index=index,
                                                           item=announced)]
        if isinstance(item, wire.OutputMessage):
            events.append(oa.ContentPartAdded(sequence_number=self._number(), item_id=item.id, output_index=index,
                                              content_index=0, part=oa.OutputText(text="")))
        return events

    def _reasoning_delta(self, delta: wire.ReasoningSummaryTextDelta) -> list[oa.StreamEvent]:
        index = self._index[delta.item_id]
        self._texts.setdefault(delta.item_id, []).append(delta.delta)
        events: list[oa.StreamEvent] = []
        if delta.item_id not in self._summaries:
            self._summaries.add(delta.item_id)
            events.append(oa.SummaryPartAdded(sequence_number=self._number(), item_id=delta.item_id,
                                              output_index=index, summary_index=0, part=oa.SummaryText(text="")))
        events.append(oa.SummaryTextDelta(sequence_number=self._number(), item_id=delta.item_id, output_index=index,
                                          summary_index=0, delta=delta.delta))
        return events

    def _item_done(self, item: wire.OutputItem, index: int) -> list[oa.StreamEvent]:
        done = output_item(item, "completed")
        self._items[index] = done
        self._done.add(index)
        events: list[oa.StreamEvent] = []
        if isinstance(item, wire.OutputMessage):
            text = "".join(part.text for part in item.content)
            logprobs = [entry for part in item.content for entry in part.logprobs or ()]
            events += [
                oa.OutputTextDone(sequence_number=self._number(), item_id=item.id, output_index=index,
                                  content_index=0, text=text, logprobs=logprobs),
                oa.ContentPartDone(sequence_number=self._number(), item_id=item.id, output_index=index,
                                   content_index=0, part=oa.OutputText(text=text, logprobs=logprobs)),
            ]
        elif isinstance(item, wire.OutputFunctionCall):
            events += [
                oa.ArgumentsDelta(sequence_number=self._number(), item_id=item.id, output_index=index,
                                  delta=item.arguments),
                oa.ArgumentsDone(sequence_number=self._number(), item_id=item.id, output_index=index,
                                 arguments=item.arguments),
            ]
        elif item.id in self._summaries:
            text = "".join(part.text for part in item.summary)
            events += [
                oa.SummaryTextDone(sequence_number=self._number(), item_id=item.id, output_index=index,
                                   summary_index=0, text=text),
                oa.SummaryPartDone(sequence_number=self._number(), item_id=item.id, output_index=index,
                                   summary_index=0, part=oa.SummaryText(text=text)),
            ]
        events.append(oa.OutputItemDone(sequence_number=self._number(), output_index=index, item=done))
        return events

    def output(self) -> list[oa.OutputItem]:
        """The items so far; one that never got its ``done`` is ``incomplete``, with the text it had."""
        return [item if index in self._done else self._unfinished(item) for index, item in sorted(self._items.items())]

    def _unfinished(self, item: oa.OutputItem) -> oa.OutputItem:
        text = "".join(self._texts.get(item.id, ()))
        if isinstance(item, oa.Message):
            return msgspec.structs.replace(item, status="incomplete", content=[oa.OutputText(text=text)])
        if isinstance(item, oa.Reasoning):
            return msgspec.structs.replace(item, status="incomplete",
                                           summary=[oa.SummaryText(text=text)] if text else [])
        return msgspec.structs.replace(item, status="incomplete")

    def _final(self, name: str, data: bytes) -> oa.StreamEvent:
        number, view, output = self._number(), self.view, self.output()
        if name == wire.COMPLETED:
            completed = msgspec.json.decode(data, type=wire.ResponseCompleted)
            return oa.ResponseCompleted(sequence_number=number, response=view.response(
                "completed", output, usage=usage(completed.usage)))
        if name == wire.INCOMPLETE:
            incomplete = msgspec.json.decode(data, type=wire.ResponseIncomplete)
            return oa.ResponseIncomplete(sequence_number=number, response=view.response(
                "incomplete", output, usage=usage(incomplete.usage),
                incomplete=oa.IncompleteDetails(reason=incomplete.incomplete_details.reason)))
        if name == wire.FAILED:
            failed = msgspec.json.decode(data, type=wire.ResponseFailed)
            return oa.ResponseFailed(sequence_number=number, response=view.response(
                "failed", output, error=response_error(failed.error)))
        # OpenAI defines no event for a cancelled response: it ends as incomplete, with status cancelled
        return oa.ResponseIncomplete(sequence_number=number, response=view.response("cancelled", output))


def render_all(view: ResponseView, events: Sequence[Event]) -> list[oa.StreamEvent]:
    """The whole rendering of a log (tests and documentation examples)."""
    renderer = EventRenderer(view)
    return renderer.opening() + [rendered for event in events for rendered in renderer.render(event)]
