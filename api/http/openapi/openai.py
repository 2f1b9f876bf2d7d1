"""OpenAPI documentation of the ``/v1`` routes: examples rendered by the adapter itself (from a
sample task and its log), OpenAI error objects per status, and streamed answers documented as
``text/event-stream`` next to their JSON form."""

from typing import Any, get_args

import msgspec
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Example, Operation

from api.follow.framing import DONE, data_frame, event_frames
from api.http.openapi import document as doc
from api.http.openapi import eventstreams as streamdoc
from api.openai import batches as ob
from api.openai import chatobjects as co
from api.openai import conversations as oc
from api.openai import objects as oa
from api.openai import requests as rq
from api.openai.chat import ChunkRenderer, completion
from api.openai.errors import MEDIA_TYPE, ErrorObject, error_object
from api.openai.files import FileDeleted, file_list, file_object
from api.openai.inputitems import input_items, page
from api.openai.rendering import ResponseView, render_all, response_object
from lmsp_core import wire
from lmsp_core.store.objects.batches import BatchRecord
from lmsp_core.store.objects.conversations import StoredResponse
from lmsp_core.store.objects.files import FileRecord
from lmsp_core.store.tasks import eventlog
from lmsp_core.store.tasks.records import Kind, TaskRecord
from lmsp_core.wire.errors import problem

_CALL = "call_01J8M6Q4W9D3F6H8K2M4P6R8TV"
_EVENTS: list[tuple[str, Any]] = [
    (wire.CREATED, wire.ResponseCreated(response_id=doc.RESPONSE_ID)),
    (wire.ITEM_ADDED, wire.OutputItemAdded(response_id=doc.RESPONSE_ID, output_index=0,
                                           item=wire.OutputMessage(id=doc.MESSAGE_ID))),
    (wire.TEXT_DELTA, wire.OutputTextDelta(response_id=doc.RESPONSE_ID, item_id=doc.MESSAGE_ID, delta=doc.TEXT)),
    (wire.ITEM_DONE, wire.OutputItemDone(response_id=doc.RESPONSE_ID, output_index=0, item=doc.RESPONSE.output[0])),
    (wire.COMPLETED, wire.ResponseCompleted(response_id=doc.RESPONSE_ID, status="completed", usage=doc.USAGE)),
]


def _sample(kind: Kind) -> TaskRecord:
    request = wire.ResponseRequest(model=doc.MODEL, input=doc.REQUEST.input, max_output_tokens=64, store=True)
    return TaskRecord(id=doc.TASK_ID, model=doc.MODEL, owner="local", kind=kind, status="completed",
                      created_at=1794200000, finished_at=1794200003, response_id=doc.RESPONSE_ID,
                      request=wire.encoder.encode(request), response=wire.encoder.encode(doc.RESPONSE))


_LOG = [eventlog.Event(number, name, wire.encoder.encode(data)) for number, (name, data) in enumerate(_EVENTS, 1)]
RESPONSE = response_object(ResponseView(_sample("direct")))
QUEUED = msgspec.structs.replace(response_object(ResponseView(_sample("task"))), status="queued", output=[],
                                 usage=None, completed_at=None)
EVENT_STREAM = event_frames(render_all(ResponseView(_sample("direct")), _LOG)).decode()
CHAT = completion(_sample("direct"))
_CHUNKS = ChunkRenderer(_sample("direct"), include_usage=True)
CHAT_STREAM = (b"".join(data_frame(chunk) for event in _LOG for chunk in _CHUNKS.render(event)) + DONE).decode()
MODELS = oa.ModelList(data=[oa.Model(id=doc.MODEL)])
_TURN = StoredResponse(response_id=doc.RESPONSE_ID, task_id=doc.TASK_ID, owner="local", model=doc.MODEL,
                       created_at=1794200000, input=doc.REQUEST.input)
INPUT_ITEMS = page(input_items(_TURN), limit=20, order="desc", after=None)
DELETED = wire.DeletedResponse(id=doc.RESPONSE_ID)
_CONVERSATION_ID = "conv_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
CONVERSATION = oc.Conversation(id=_CONVERSATION_ID, created_at=1794200000, metadata={"topic": "queues"})
CONVERSATION_DELETED = oc.ConversationDeleted(id=_CONVERSATION_ID)
CONVERSATION_ITEMS = oc.item_list([msgspec.structs.replace(item, id=doc.MESSAGE_ID) for item in doc.REQUEST.input])
CONVERSATION_ITEM = CONVERSATION_ITEMS.data[0]
_FILE_ID = "file_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
_FILE = FileRecord(id=_FILE_ID, owner="local", purpose="batch", filename="requests.jsonl", bytes=18_604,
                   created_at=1794200000, expires_at=1796792000, lines=100)
FILE = file_object(_FILE)
FILE_LIST = file_list([_FILE], has_more=False)
FILE_DELETED = FileDeleted(id=_FILE_ID)
_BATCH_ID = "batch_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
_INPUT_FILE = "file_01J8M6Q4W2T7N5R3V9X1Z8B0DF"
BATCH = ob.batch_object(BatchRecord(
    id=_BATCH_ID, owner="local", endpoint="/v1/chat/completions", input_file_id=_INPUT_FILE,
    completion_window="24h", status="completed", created_at=1794200000, expires_at=1794286400, total=1000,
    started=1000, completed=998, failed=2, in_progress_at=1794200001, finalizing_at=1794200900,
    completed_at=1794200901, output_file_id="file_01J8M6Q4W2T7N5R3V9X1Z8B0DG",
    error_file_id="file_01J8M6Q4W2T7N5R3V9X1Z8B0DH"))
BATCH_LIST = ob.BatchList(data=[BATCH], first_id=_BATCH_ID, last_id=_BATCH_ID, has_more=False)
BATCH_REQUESTS = [doc.example("Chat completions, within a day", ob.BatchCreate(
    input_file_id=_INPUT_FILE, endpoint="/v1/chat/completions", completion_window="24h",
    metadata={"job": "nightly-summaries"}))]

RESPONSES_REQUESTS = [
    doc.example("A short answer", rq.ResponsesRequest(model=doc.MODEL, input="Describe a local model service.",
                                                      max_output_tokens=64)),
    doc.example("Background, streamed (resumable)", rq.ResponsesRequest(
        model=doc.MODEL, input="Write a haiku about queues.", instructions="Answer briefly.", background=True,
        stream=True)),
    doc.example("A function the model may call", rq.ResponsesRequest(
        model=doc.MODEL, input="What is the weather in Paris?", tool_choice="auto", tools=[rq.FunctionTool(
            name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}},
                                            "required": ["city"]})])),
]
INPUT_TOKENS = oa.InputTokens(input_tokens=19)
_MESSAGE = {"type": "message", "role": "user", "content": "Describe a local model service."}
CONVERSATION_REQUESTS = [doc.example("A conversation with its first message", oc.ConversationCreate(
    items=[_MESSAGE], metadata={"topic": "services"}))]
CONVERSATION_UPDATES = [doc.example("New metadata", oc.ConversationUpdate(metadata={"topic": "local models"}))]
ITEMS_REQUESTS = [doc.example("A user message", oc.ItemsCreate(items=[_MESSAGE]))]

INPUT_TOKENS_REQUESTS = [
    doc.example("A prompt with instructions", rq.InputTokensRequest(
        model=doc.MODEL, input="Describe a local model service.", instructions="Answer briefly.")),
    doc.example("With a tool", rq.InputTokensRequest(
        model=doc.MODEL, input="What is the weather in Paris?", tools=[rq.FunctionTool(
            name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}},
                                            "required": ["city"]})])),
]
CHAT_REQUESTS = [
    doc.example("A short answer", rq.ChatRequest(model=doc.MODEL, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Describe a queue."}],
        max_completion_tokens=64)),
    doc.example("Streamed, with usage", rq.ChatRequest(
        model=doc.MODEL, messages=[{"role": "user", "content": "Write a haiku about queues."}], stream=True,
        stream_options=rq.ChatStreamOptions(include_usage=True))),
]

# the errors of the /v1 routes: status and an example message per code
_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "invalid_request": (400, "Invalid value for 'max_output_tokens': Expected `int` >= 1.", "max_output_tokens"),
    "unsupported_parameter": (400, "Unsupported parameter: 'logit_bias' is not supported by this service.",
                              "logit_bias"),
    "object_above_max_properties": (400, "Invalid 'metadata': too many properties. Expected an object with at "
                                         "most 16 properties, but got an object with 17 properties instead.",
                                    "metadata"),
    "string_above_max_length": (400, "Invalid 'prompt_cache_key': string too long. Expected a string with maximum "
                                     "length 64, but got a string with length 70 instead.", "prompt_cache_key"),
    "invalid_cursor": (400, f"after 'msg_{'0' * 26}' names no input item of this response.", "after"),
    "unsupported_value": (400, "One choice is returned (n: 1).", "n"),
    "context_length_exceeded": (400, "The prompt has 9000 tokens; the context window of model "
                                     f"{doc.MODEL!r} is 8192 tokens.", "input"),
    "invalid_value": (400, "top_logprobs must be from 0 to 20.", "top_logprobs"),
    "invalid_idempotency_key": (400, "Idempotency-Key must be 1-255 visible ASCII characters.", None),
    "unsupported_capability": (400, f"Model {doc.MODEL!r} does not support tools.", "tools"),
    "max_output_tokens_too_large": (400, f"max_output_tokens is 9000; model {doc.MODEL!r} allows at most 4096.",
                                    "max_output_tokens"),
    "max_output_tokens_too_small": (400, "max_output_tokens is 4; the shortest complete output of this request (its "
                                         f"tool call) takes 9 tokens with model {doc.MODEL!r}.", "max_output_tokens"),
    "too_many_input_items": (400, "input has 2000 items; at most 1000 are allowed.", "input"),
    "too_many_tools": (400, "The request has 200 tools; at most 128 are allowed.", "tools"),
    "input_too_long": (400, "The input has 2000000 characters of text; at most 1000000 are allowed.", "input"),
    "unknown_tool": (400, "tool_choice names 'get_time', which is not among the tools.", "tool_choice"),
    "invalid_tool_choice": (400, "tool_choice 'required' needs at least one tool.", "tool_choice"),
    "duplicate_tool_name": (400, "Two tools are named 'get_weather'.", "tools"),
    "unmatched_call_id": (400, "The function_call_output's call_id 'call_1' matches no earlier function_call.",
                          "input"),
    "invalid_tool_schema": (400, "The parameters of tool 'get_weather' are not a JSON Schema the grammar engine can "
                                 "enforce.", "tools"),
    "invalid_json_schema": (400, "The response format's schema cannot be enforced.", "text.format"),
    "previous_response_in_progress": (400, f"Response {doc.RESPONSE_ID!r} is not final.", "previous_response_id"),
    "conversation_too_long": (400, "The conversation has more than 1000 stored turns.", "previous_response_id"),
    "invalid_file_format": (400, "Line 3 of the file is not a JSON object.", "file"),
    "too_many_lines": (400, "The file has more than 50000 requests (non-blank lines); split it into several "
                              "batches.", "file"),
    "not_cancellable": (400, "Only background responses can be cancelled.", None),
    "unauthorized": (401, "This operation needs a bearer token: Authorization: Bearer <token>.", None),
    "insufficient_scope": (403, "This operation needs the 'responses:write' scope.", None),
    "model_not_found": (404, "Model 'no-such-model' does not exist.", "model"),
    "batch_not_found": (404, f"Batch {_BATCH_ID!r} does not exist.", None),
    "file_not_found": (404, "File 'file_01J8M6Q4W2T7N5R3V9X1Z8B0DF' does not exist.", None),
    "conversation_not_found": (404, "Conversation 'conv_01J8M6Q4W2T7N5R3V9X1Z8B0DF' does not exist (or has "
                                    "expired).", None),
    "item_not_found": (404, f"Item {doc.MESSAGE_ID!r} does not exist in conversation "
                            "'conv_01J8M6Q4W2T7N5R3V9X1Z8B0DF'.", None),
    "conversation_locked": (400, "Another response of conversation 'conv_01J8M6Q4W2T7N5R3V9X1Z8B0DF' is still "
                                 "being generated; retry once it is final.", "conversation"),
    "mutually_exclusive_parameters": (400, "Mutually exclusive parameters: provide either 'previous_response_id' "
                                           "or 'conversation', not both.", "conversation"),
    "unsupported_content_type": (400, "Content of type 'input_image' is not supported: this service takes text "
                                      "only.", "items[0].content[0].type"),
    "response_not_found": (404, f"Response {doc.RESPONSE_ID!r} does not exist (or was not stored, or has "
                                "expired).", None),
    "event_history_expired": (410, "The events of this response have expired; retrieve it without stream.", None),
    "file_too_large": (413, "The file is larger than this service accepts (104857600 bytes).", "file"),
    "idempotency_key_reused": (422, "This Idempotency-Key was already used with a different request.", None),
    "rate_limited": (429, "More than 600 requests in 60 s; retry later.", None),
    "too_many_streams": (429, "This principal already has 32 open streams.", None),
    "queue_quota_exceeded": (429, f"Principal 'acme' already has 1000 tasks waiting for model {doc.MODEL!r} (its "
                                  "max_queued); retry once some have started.", None),
    "generation_failed": (500, "The model failed while generating.", None),
    "service_unavailable": (503, "The service's store is unreachable; retry shortly.", None),
    "model_unavailable": (503, f"No worker is running model {doc.MODEL!r} right now.", None),
    "server_busy": (503, f"The queue of model {doc.MODEL!r} is full (1000 tasks); retry later.", None),
}
COMMON_ERRORS = ("invalid_request", "unauthorized", "insufficient_scope", "rate_limited", "service_unavailable")
# what the translation and the checks against the model refuse (both routes, and a count of tokens)
REQUEST_ERRORS = ("unsupported_parameter", "unsupported_value", "invalid_value", "object_above_max_properties",
                  "string_above_max_length", "unsupported_capability", "unsupported_content_type",
                  "max_output_tokens_too_large", "max_output_tokens_too_small", "too_many_input_items",
                  "too_many_tools", "input_too_long", "unknown_tool", "invalid_tool_choice", "duplicate_tool_name",
                  "unmatched_call_id", "invalid_tool_schema", "invalid_json_schema", "model_not_found")
# the stored response that previous_response_id continues
CONTINUATION_ERRORS = ("response_not_found", "previous_response_in_progress", "conversation_too_long")
GENERATION_ERRORS = (*COMMON_ERRORS, *REQUEST_ERRORS, "context_length_exceeded", "invalid_idempotency_key",
                     "event_history_expired", "idempotency_key_reused", "too_many_streams", "generation_failed",
                     "model_unavailable", "server_busy", "queue_quota_exceeded")


def errors(*codes: str) -> dict[int, ResponseSpec]:
    """OpenAI error objects, one example per code, grouped by status."""
    by_status: dict[int, list[Example]] = {}
    for code in codes:
        status, message, param = _ERRORS[code]
        value = error_object(problem(status, code, "", message), param)
        by_status.setdefault(status, []).append(doc.LiteralExample(id=code, summary=code, value=msgspec.to_builtins(
            value)))
    return {status: ResponseSpec(data_container=ErrorObject, media_type=MEDIA_TYPE, examples=examples,
                                 generate_examples=False,
                                 description="OpenAI's error object; `code` is the service's stable code")
            for status, examples in by_status.items()}


def ok(data_container: Any, description: str, value: Any) -> ResponseSpec:
    return doc.ok(data_container, description, doc.LiteralExample(summary="Example", value=msgspec.to_builtins(value)))


def _tag(kind: Any) -> str:
    tag: str = kind.__struct_config__.tag
    return tag


# each Responses stream event is `event: <type>` with the object as data; chat chunks are unnamed
# (`message` to a parser) and end with `data: [DONE]`, which is not JSON
RESPONSE_EVENTS = streamdoc.event_schema({_tag(kind): streamdoc.json_data(kind) for kind in get_args(oa.StreamEvent)},
                                         numbered=False)
CHAT_EVENTS = streamdoc.event_schema({"message": {"anyOf": [{"type": "string", "const": "[DONE]"},
                                                            streamdoc.json_data(co.ChatCompletionChunk)]}},
                                     numbered=False)


def with_event_stream(description: str, schema: streamdoc.JsonSchema, example: str) -> type[Operation]:
    """An operation class that documents ``text/event-stream`` as the other form of its ``200``."""
    return streamdoc.streaming(description, schema, doc.LiteralExample(summary="Server-sent events", value=example))
