"""Every Redis key and channel the service uses, in one place.

Keys of one task share the hash tag ``{task_id}`` so that the Lua scripts that touch a task's
record and its event stream together stay within one slot on Redis Cluster, and tasks spread over
the shards. A model's queue, its fair share, its wake channel and arq's keys of its jobs share the
model's tag (``model_tag``): arq's transactions and the fair queue's scripts stay in one slot. arq
names the keys of its jobs itself, from the job id, which carries that tag (``job_id``); the
functions at the end only spell them for the reaper.
"""

import hashlib

from arq.constants import in_progress_key_prefix, job_key_prefix, retry_key_prefix

PREFIX = "lmsp"


def task(task_id: str) -> str:
    """Hash: the task record (request, owner, status, timestamps, lease, result)."""
    return f"{PREFIX}:task:{{{task_id}}}"


def events(task_id: str) -> str:
    """Stream: the task's numbered events, entry ids ``0-1``, ``0-2``, ..."""
    return f"{PREFIX}:task:{{{task_id}}}:events"


def token_ids(task_id: str) -> str:
    """String: generated token ids (uint32 little-endian), the worker's resume checkpoint."""
    return f"{PREFIX}:task:{{{task_id}}}:tokens"


def stored(task_id: str) -> str:
    """Hash: a stored response (``store: true``): owner, this turn's input, the previous response
    id, and the response once final. Shares the task's hash tag: the final write is atomic."""
    return f"{PREFIX}:task:{{{task_id}}}:stored"


def response(response_id: str) -> str:
    """String: the task id of a stored response, for GET /lmsp/v1/responses/{id}."""
    return f"{PREFIX}:response:{{{response_id}}}"


def script_keys(task_id: str) -> list[str]:
    """The keys the task scripts (``lmsp_core.store.scripts``) take, in their order."""
    return [task(task_id), events(task_id), token_ids(task_id), stored(task_id)]


def owner_tasks(owner: str) -> str:
    """Sorted set: an owner's task ids scored by creation time (ms), for ``GET /lmsp/v1/tasks``.
    Capped in length, expired with the task retention, and entries whose record expired are
    dropped when a listing meets them."""
    return f"{PREFIX}:owner:{owner}:tasks"


def model_tag(model_id: str) -> str:
    """The hash tag of a model's queue keys: its id, or a digest of an id that has braces in it
    (which would end the tag early)."""
    if "{" in model_id or "}" in model_id:
        return hashlib.sha1(model_id.encode()).hexdigest()[:16]
    return model_id


def job_id(task_id: str, model_id: str) -> str:
    """The id of a task's first arq job, ``task_id{model tag}``: arq's keys of the job
    (``arq:job:<id>``, ...) hash to its model's queue slot. A reaper's fresh job adds ``:<n>``."""
    return f"{task_id}{{{model_tag(model_id)}}}"


def task_of_job(job: str) -> str:
    """The task whose job this is (``job_id``, or a reaper's ``<job id>:<n>``)."""
    return job.partition("{")[0]


def active_tasks(model_id: str) -> str:
    """Sorted set: the model's unfinished tasks, each scored by when a reaper should next look at it
    (Redis server time, ms). Only an index: the task hash is the truth, and entries of tasks that
    finished or vanished are dropped when they come due (see ``workers/reaper.py``)."""
    return f"{PREFIX}:active:{{{model_tag(model_id)}}}"


def queue(model_id: str) -> str:
    """arq queue (sorted set of job ids) of a model."""
    return f"{PREFIX}:queue:{{{model_tag(model_id)}}}"


def fair_queue(model_id: str) -> list[str]:
    """The keys of a model's fair share between principals (``lmsp_core.store.tasks.fairqueue``), in the
    order its scripts take them; one hash tag per model, so that each script stays in one slot:

    - ``waiting``: sorted set, every score 0, member ``principal SOH queue-score SOH job``: the
      jobs no worker picked yet, each principal's in its own queue order (``ZRANGEBYLEX``);
    - ``ready``: sorted set, principal -> its pass (service received / weight), principals with
      waiting jobs only;
    - ``state``: hash, principal -> pass of a principal with no waiting job, ``:v`` -> the pass at
      which the last job was picked (the virtual time a returning principal starts from);
    - ``running``: sorted set, member ``principal SOH job``, score: when the entry lapses (server
      ms) unless the job's worker renews it;
    - ``jobs``: hash, job id -> ``principal SOH queue-score SOH cost``, from enqueue until the job ends.
    """
    base = f"{PREFIX}:fair:{{{model_tag(model_id)}}}"
    return [f"{base}:waiting", f"{base}:ready", f"{base}:state", f"{base}:running", f"{base}:jobs"]


def wake_channel(model_id: str) -> str:
    """Pub/sub channel: published after an enqueue so idle workers poll at once (sharded on a
    cluster, in the queue's slot)."""
    return f"{PREFIX}:wake:{{{model_tag(model_id)}}}"


def cancel_channel(worker_id: str) -> str:
    """Pub/sub channel: the ids of the worker's running tasks that a client cancelled."""
    return f"{PREFIX}:cancel:{worker_id}"


def hub_wake(hub_id: str) -> str:
    """Stream an API process's event hub reads beside the tasks it follows: an entry added here ends
    the hub's blocking read, so that its next one includes a task it just began to follow."""
    return f"{PREFIX}:hubwake:{hub_id}"


def replication_mark(key: str) -> str:
    """Pub/sub channel that nobody reads: an empty message published before WAIT, so that the WAIT
    covers every write made before it (see ``lmsp_core.store.connections.replicated``); in the slot
    of ``key``, whose shard the WAIT is about on a cluster."""
    return f"{PREFIX}:replicated:{{{hash_tag(key)}}}"


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes of a key: the text between its first ``{`` and the next ``}``
    when that is not empty, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1)
    return key[start + 1:end] if start >= 0 and end > start + 1 else key


def model_card(model_id: str) -> str:
    """String: the model card a worker publishes (tokenizer and chat template)."""
    return f"{PREFIX}:model:{{{model_tag(model_id)}}}:card"


def model_card_digest(model_id: str) -> str:
    """String: digest of the model card, so readers can tell cheaply whether it changed."""
    return f"{PREFIX}:model:{{{model_tag(model_id)}}}:card-digest"


def workers() -> str:
    """Sorted set: worker id -> expiry time (ms) of its last heartbeat."""
    return f"{PREFIX}:{{workers}}"


def metrics() -> str:
    """Hash: service-wide counters and histogram buckets that workers and API processes add to
    (see ``lmsp_core.store.metrics``); the API exports them at ``/metrics``."""
    return f"{PREFIX}:metrics"


def worker(worker_id: str) -> str:
    """Hash: what a worker runs (models, host, pid, started_at)."""
    return f"{PREFIX}:{{workers}}:worker:{worker_id}"


# --- batches (``lmsp_core.store.objects.batches``): one hash tag per batch ----------------------------------


def batch(batch_id: str) -> str:
    """Hash: a batch (what was asked, status, timestamps, counters)."""
    return f"{PREFIX}:batch:{{{batch_id}}}"


def batch_lines(batch_id: str) -> str:
    """List: the batch's input lines, one entry a line."""
    return f"{PREFIX}:batch:{{{batch_id}}}:lines"


def batch_tasks(batch_id: str) -> str:
    """Hash: line number -> the task of that line."""
    return f"{PREFIX}:batch:{{{batch_id}}}:tasks"


def batch_open(batch_id: str) -> str:
    """Set: the line numbers whose task has not ended."""
    return f"{PREFIX}:batch:{{{batch_id}}}:open"


def batch_results(batch_id: str) -> str:
    """Hash: line number -> its output or error line (JSON), written once."""
    return f"{PREFIX}:batch:{{{batch_id}}}:results"


def owner_batches(owner: str) -> str:
    """Sorted set: an owner's batch ids by creation time (ms), for listing."""
    return f"{PREFIX}:owner:{owner}:batches"


def batches_due() -> str:
    """Sorted set: batch id -> when a driver should next look at it (server ms)."""
    return f"{PREFIX}:batches:due"


# --- files (``lmsp_core.store.objects.files``, OpenAI's /v1/files): one hash tag per file ---------------


def file(file_id: str) -> str:
    """Hash: a file's record (owner, purpose, filename, bytes, created_at, expires_at, lines)."""
    return f"{PREFIX}:file:{{{file_id}}}"


def file_content(file_id: str) -> str:
    """List: a file's content in chunks (``files.CHUNK_BYTES`` each, the last one shorter)."""
    return f"{PREFIX}:file:{{{file_id}}}:content"


def file_staging(file_id: str, nonce: str) -> str:
    """List: content being written, renamed to ``file_content`` when the record is written."""
    return f"{PREFIX}:file:{{{file_id}}}:staging:{nonce}"


def owner_files(owner: str) -> str:
    """Sorted set: an owner's file ids by creation time (ms), for listing; entries whose record
    expired are dropped when a listing meets them."""
    return f"{PREFIX}:owner:{owner}:files"


# --- conversations (``lmsp_core.store.objects.conversationobjects``, OpenAI's /v1/conversations): one
# hash tag per conversation, so that its scripts (append, a response's turn) stay in one slot


def conversation(conversation_id: str) -> str:
    """Hash: a conversation's record (owner, created_at, metadata) and ``next``, its next item's place."""
    return f"{PREFIX}:conversation:{{{conversation_id}}}"


def conversation_order(conversation_id: str) -> str:
    """Sorted set: the conversation's item ids, scored by their place."""
    return f"{PREFIX}:conversation:{{{conversation_id}}}:order"


def conversation_items(conversation_id: str) -> str:
    """Hash: item id -> the item (JSON of an LMSP input item, with its id)."""
    return f"{PREFIX}:conversation:{{{conversation_id}}}:items"


def conversation_turns(conversation_id: str) -> str:
    """Hash: response id -> ``task place input-ids...`` of a response whose output is not in the
    conversation yet: the place its output items will take."""
    return f"{PREFIX}:conversation:{{{conversation_id}}}:turns"


def conversation_keys(conversation_id: str) -> list[str]:
    """The keys the conversation scripts take, in their order."""
    return [conversation(conversation_id), conversation_order(conversation_id), conversation_items(conversation_id),
            conversation_turns(conversation_id)]


def task_conversation(task_id: str) -> str:
    """String: the conversation a task's response is a turn of (its task's hash tag, its retention)."""
    return f"{PREFIX}:task:{{{task_id}}}:conversation"


# --- security: credentials (bearer tokens), idempotency, rate and stream limits ---------------
# Credential keys share the hash tag ``{auth}`` so that creating or revoking a token (the token and
# the index together) is one transaction on Redis Cluster too. Tokens are few; one slot is fine.
# A principal's idempotency keys, rate window and open streams share the tag ``{principal:NAME}``:
# one principal's request touches one shard, and principals spread over the shards.


def credential(token_hash: str) -> str:
    """String: JSON of a token's record (id, principal, scopes), keyed by the SHA-256 of the token."""
    return f"{PREFIX}:{{auth}}:token:{token_hash}"


def credential_index() -> str:
    """Hash: token id -> SHA-256 of the token (for listing and revoking by id)."""
    return f"{PREFIX}:{{auth}}:tokens"


def principals() -> str:
    """Hash: principal -> JSON of its settings (weight, quotas; ``lmsp_core.store.tenants.principals``)."""
    return f"{PREFIX}:{{auth}}:principals"


def idempotency(principal: str, key_digest: str) -> str:
    """String: ``{task_id, fingerprint}`` of a principal's Idempotency-Key (digest of the key)."""
    return f"{PREFIX}:idem:{{principal:{principal}}}:{key_digest}"


def rate(principal: str) -> str:
    """String: a principal's request count in the current fixed window (expires with the window)."""
    return f"{PREFIX}:rate:{{principal:{principal}}}"


def streams(principal: str) -> str:
    """Sorted set: a principal's open SSE streams (member per stream, score: its lease expiry, ms)."""
    return f"{PREFIX}:streams:{{principal:{principal}}}"


# --- webhooks (``lmsp_core.store.objects.webhooks``) ------------------------------------------------------
# Their keys share the hash tag ``{webhooks}`` so that creating a delivery (its record, its
# endpoint's list and the due index) is one script on Redis Cluster too. Endpoints are few and
# deliveries small; one slot is fine.


def finished() -> str:
    """Stream: the ids of tasks that ended, added at least once (by the worker that ended a task, the
    API that cancelled a queued one, the reaper that drops a final task from its index); the API
    processes read it in two consumer groups: one turns each into webhook events, the other settles
    conversations' turns (``lmsp_core.store.objects.conversationobjects``)."""
    return f"{PREFIX}:finished"


def webhook(endpoint_id: str) -> str:
    """String: JSON of a webhook endpoint (owner, url, event types, signing secret, created_at)."""
    return f"{PREFIX}:{{webhooks}}:endpoint:{endpoint_id}"


def owner_webhooks(owner: str) -> str:
    """Sorted set: a principal's endpoint ids by creation time (ms)."""
    return f"{PREFIX}:{{webhooks}}:owner:{owner}"


def all_webhooks() -> str:
    """Sorted set: every endpoint id by creation time (ms), for ``lmsp webhook list``."""
    return f"{PREFIX}:{{webhooks}}:endpoints"


def webhook_deliveries(endpoint_id: str) -> str:
    """Sorted set: an endpoint's delivery ids by creation time (server ms), capped in length."""
    return f"{PREFIX}:{{webhooks}}:endpoint:{endpoint_id}:deliveries"


def delivery(delivery_id: str) -> str:
    """Hash: one event for one endpoint (the body as first signed, status, attempts)."""
    return f"{PREFIX}:{{webhooks}}:delivery:{delivery_id}"


def deliveries_due() -> str:
    """Sorted set: pending delivery id -> when its next attempt is due (server ms)."""
    return f"{PREFIX}:{{webhooks}}:due"


# --- arq's own keys of a job, spelled here for the reaper, which removes those of a dead job ------


def arq_in_progress(job_id: str) -> str:
    """String (arq's): marks a job as running; set when a worker starts it."""
    return in_progress_key_prefix + job_id


def arq_job(job_id: str) -> str:
    """String (arq's): a job's definition (function, arguments, enqueue time)."""
    return job_key_prefix + job_id


def arq_job_keys(job_id: str) -> list[str]:
    """arq's keys of a job: its definition, its running marker and its try count."""
    return [arq_job(job_id), arq_in_progress(job_id), retry_key_prefix + job_id]
