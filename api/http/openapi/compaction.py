"""OpenAPI examples of ``POST /v1/responses/compact``: a request and its answer, rendered by the
adapter itself (``api.openai.compaction``) from a sample summarising task."""

from api.http.openapi import document as doc
from api.openai import compaction
from api.openai.compactionitem import CompactionItem
from lmsp_core import wire
from lmsp_core.store.tasks.records import TaskRecord

_SUMMARY = "The user asked what a local model service is; it was described as a resident interface layer."
_CONVERSATION: list[wire.InputItem] = [
    wire.Message(role="user", content=[wire.InputText(text="Describe a local model service.")]),
    wire.Message(role="assistant", content=[wire.OutputText(text=doc.TEXT)]),
]
_RESPONSE = wire.Response(id=doc.RESPONSE_ID, created_at=1794200000, status="completed", model=doc.MODEL,
                          output=[wire.OutputMessage(id=doc.MESSAGE_ID, content=[wire.OutputTextPart(text=_SUMMARY)])],
                          usage=doc.USAGE)
_TASK = TaskRecord(id=doc.TASK_ID, model=doc.MODEL, owner="local", kind="direct", status="completed",
                   created_at=1794200000, finished_at=1794200003, response_id=doc.RESPONSE_ID,
                   request=b"{}", response=wire.encoder.encode(_RESPONSE))
_ANSWER = compaction.compacted(_TASK, _CONVERSATION)
COMPACTED = compaction.Compacted(
    id=_ANSWER.id, created_at=_ANSWER.created_at, usage=_ANSWER.usage,
    output=[*_ANSWER.output[:-1], CompactionItem(id="cmp_01J8M6Q4W2T7N5R3V9X1Z8B0DF", encrypted_content=_SUMMARY)])

REQUESTS = [
    doc.example("A conversation given as input", compaction.CompactRequest(model=doc.MODEL, input=[
        {"role": "user", "content": "Describe a local model service."},
        {"role": "assistant", "content": doc.TEXT}])),
    doc.example("A stored conversation", compaction.CompactRequest(model=doc.MODEL,
                                                                    previous_response_id=doc.RESPONSE_ID)),
]
