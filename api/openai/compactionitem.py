"""The ``compaction`` item: what ``POST /v1/responses/compact`` ends its item list with, and what a
later request takes back as input (``api.openai.compaction`` makes it; ``api.openai.translation``
reads it).

OpenAI's item carries ``encrypted_content``, opaque to clients. This service has nothing to hide
from the principal whose conversation it summarised, so the content is the model's summary as it
wrote it (docs/protocol.md, "OpenAI compatibility"). Taken back as input it becomes an assistant
message that says what it is, so every chat template renders it where the conversation had been.
"""

import msgspec

from lmsp_core import wire
from lmsp_core.wire import ids

TYPE = "compaction"
ID_PREFIX = "cmp"
# how the summary reads to the model when the item comes back as input
SUMMARY_HEADING = "Summary of the conversation so far:\n"
MAX_CONTENT = 10_485_760  # OpenAI's bound on a text input


class CompactionItem(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type",
                     tag=TYPE):
    """The item, as OpenAI's SDKs send it back (``ResponseCompactionItemParam``) and as it is answered."""

    encrypted_content: str
    id: str | None = None
    created_by: str | None = None


def new_item(summary: str) -> CompactionItem:
    return CompactionItem(encrypted_content=summary, id=ids.new_id(ID_PREFIX))


def as_input(item: CompactionItem) -> wire.Message:
    """The item as the conversation's input: the summary, said to be one, as the assistant's turn."""
    return wire.Message(role="assistant", content=[wire.OutputText(text=SUMMARY_HEADING + item.encrypted_content)])
