"""A task as a chat completion: the ``chat.completion`` object from its final response, and the
``chat.completion.chunk`` stream rendered from its event log.

The message's ``content`` is the text of the response's message items, its ``tool_calls`` its
function calls (the call id is the tool call's id), ``reasoning_content`` the summary of a reasoning
item. ``finish_reason`` is ``tool_calls`` when the model called a function, ``length`` when the token
budget ran out, else ``stop``.

A stream's first chunk (``role``) waits for the answer's first item, as its ``content`` tells what the
answer is: ``""`` for text, ``null`` for a function call or a reasoning section, as OpenAI (and
DeepSeek for reasoning) send them.
"""

import msgspec

from api.openai import chatobjects as co
from api.openai import objects as oa
from api.openai.errors import FailedGeneration
from api.openai.translation import tier_of
from lmsp_core import wire
from lmsp_core.store.tasks.eventlog import Event
from lmsp_core.store.tasks.records import TaskRecord
from lmsp_core.wire.errors import GenerationFailed

ID_PREFIX = "chatcmpl-"


def completion_id(record: TaskRecord) -> str:
    """``chatcmpl-`` and the random part of the task's response id."""
    return ID_PREFIX + record.response_id.partition("_")[2]


def completion_usage(value: wire.Usage | None) -> co.CompletionUsage | None:
    if value is None:
        return None
    cached = value.input_tokens_details.cached_tokens if value.input_tokens_details else 0
    return co.CompletionUsage(prompt_tokens=value.input_tokens, completion_tokens=value.output_tokens,
                              total_tokens=value.total_tokens,
                              prompt_tokens_details=co.PromptTokensDetails(cached_tokens=cached))


def finish_reason(status: str, called: bool) -> co.FinishReason:
    if status == "incomplete":
        return "length"
    return "tool_calls" if called else "stop"


def completion(record: TaskRecord) -> co.ChatCompletion:
    """The chat completion of a final task; raises its problem if it failed."""
    final = record.response_object()
    if final is None or final.status == "failed":
        problem = final.error if final is not None else None
        raise FailedGeneration(problem or GenerationFailed("Generation failed.").problem())
    text = "".join(part.text for item in final.output if isinstance(item, wire.OutputMessage) for part in item.content)
    calls = [co.ToolCall(id=item.call_id, function=co.ToolCallFunction(name=item.name, arguments=item.arguments))
             for item in final.output if isinstance(item, wire.OutputFunctionCall)]
    reasoning = "".join(part.text for item in final.output if isinstance(item, wire.OutputReasoning)
                        for part in item.summary)
    has_message = any(isinstance(item, wire.OutputMessage) for item in final.output)
    message = co.ChatMessage(role="assistant", content=text if has_message or not calls else None, refusal=None,
                             tool_calls=calls or None, reasoning_content=reasoning or None)
    choice = co.Choice(message=message, finish_reason=finish_reason(final.status, bool(calls)),
                       logprobs=choice_logprobs(record, final))
    metadata = record.metadata_map()
    return co.ChatCompletion(id=completion_id(record), created=int(record.created_at), model=record.model,
                             choices=[choice], usage=completion_usage(final.usage), service_tier=service_tier(record),
                             metadata=None if isinstance(metadata, msgspec.UnsetType) else metadata)


def asked_logprobs(record: TaskRecord) -> bool:
    request = msgspec.json.decode(record.request, type=wire.ResponseRequest)
    return request.known_extensions.logprobs is not None


def choice_logprobs(record: TaskRecord, final: wire.Response) -> co.ChoiceLogprobs | None:
    """The content tokens' log-probabilities, where the request asked for them."""
    if not asked_logprobs(record):
        return None
    return co.ChoiceLogprobs(content=[entry for item in final.output if isinstance(item, wire.OutputMessage)
                                      for part in item.content for entry in part.logprobs or ()])


def service_tier(record: TaskRecord) -> oa.ServiceTier:
    return tier_of(msgspec.json.decode(record.request, type=wire.ResponseRequest))


class ChunkRenderer:
    """Renders a task's log as chat completion chunks (a failure as an ``{"error": ...}`` object)."""

    def __init__(self, record: TaskRecord, include_usage: bool) -> None:
        self.id = completion_id(record)
        self.created = int(record.created_at)
        self.model = record.model
        self.include_usage = include_usage
        self.tier = service_tier(record)
        self.calls = 0
        self.opened = False  # the role chunk went out

    def _chunk(self, delta: co.Delta, finish: co.FinishReason | None = None,
               logprobs: co.ChoiceLogprobs | None = None) -> co.ChatCompletionChunk:
        return co.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, service_tier=self.tier,
                                      choices=[co.ChunkChoice(delta=delta, finish_reason=finish, logprobs=logprobs)])

    def _opening(self, text: bool) -> list[co.ChatCompletionChunk | wire.Problem]:
        """The role chunk, before the answer's first item (once)."""
        if self.opened:
            return []
        self.opened = True
        return [self._chunk(co.Delta(role="assistant", content="" if text else None))]

    def render(self, event: Event) -> list[co.ChatCompletionChunk | wire.Problem]:
        name = event.name
        if name == wire.ITEM_ADDED:
            item = msgspec.json.decode(event.data, type=wire.OutputItemAdded).item
            return self._opening(isinstance(item, wire.OutputMessage))
        if name == wire.TEXT_DELTA:
            text = msgspec.json.decode(event.data, type=wire.OutputTextDelta)
            logprobs = co.ChoiceLogprobs(content=text.logprobs) if text.logprobs else None
            return [self._chunk(co.Delta(content=text.delta), logprobs=logprobs)]
        if name == wire.REASONING_DELTA:
            delta = msgspec.json.decode(event.data, type=wire.ReasoningSummaryTextDelta).delta
            return [self._chunk(co.Delta(reasoning_content=delta))]
        if name == wire.ITEM_DONE:
            item = msgspec.json.decode(event.data, type=wire.OutputItemDone).item
            if isinstance(item, wire.OutputFunctionCall):
                self.calls += 1
                call = co.ToolCallDelta(index=self.calls - 1, id=item.call_id,
                                        function=co.ToolCallFunction(name=item.name, arguments=item.arguments))
                return [self._chunk(co.Delta(tool_calls=[call]))]
            return []
        if name == wire.FAILED:
            return [msgspec.json.decode(event.data, type=wire.ResponseFailed).error]
        if name in wire.FINAL_EVENTS:
            return self._final(name, event.data)
        return []

    def _final(self, name: str, data: bytes) -> list[co.ChatCompletionChunk | wire.Problem]:
        status = {wire.COMPLETED: "completed", wire.INCOMPLETE: "incomplete"}.get(name, "cancelled")
        chunks = [*self._opening(True), self._chunk(co.Delta(), finish_reason(status, self.calls > 0))]
        if self.include_usage and name in (wire.COMPLETED, wire.INCOMPLETE):
            used = msgspec.json.decode(data, type=wire.ResponseCompleted).usage
            chunks.append(co.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                                 service_tier=self.tier, usage=completion_usage(used)))
        return chunks
