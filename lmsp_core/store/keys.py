"""Every Redis key and channel the service uses, in one place.

Keys of one task share the hash tag ``{task_id}`` so that the Lua scripts that touch a task's
record and its event stream together stay within one slot on Redis Cluster. arq names the keys of
its jobs itself; the functions at the end only spell them for the reaper.
"""

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


def active_tasks(model_id: str) -> str:
    """Sorted set: the model's unfinished tasks, each scored by when a reaper should next look at it
    (Redis server time, ms). Only an index: the task hash is the truth, and entries of tasks that
    finished or vanished are dropped when they come due (see ``workers/reaper.py``)."""
    return f"{PREFIX}:active:{model_id}"


def queue(model_id: str) -> str:
    """arq queue (sorted set of job ids) of a model."""
    return f"{PREFIX}:queue:{model_id}"


def fair_queue(model_id: str) -> list[str]:
    """The keys of a model's fair share between principals (``lmsp_core.store.fairqueue``), in the
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
    base = f"{PREFIX}:fair:{{{model_id}}}"
    return [f"{base}:waiting", f"{base}:ready", f"{base}:state", f"{base}:running", f"{base}:jobs"]


def wake_channel(model_id: str) -> str:
    """Pub/sub channel: published after an enqueue so idle workers poll at once."""
    return f"{PREFIX}:wake:{model_id}"


def cancel_channel(worker_id: str) -> str:
    """Pub/sub channel: the ids of the worker's running tasks that a client cancelled."""
    return f"{PREFIX}:cancel:{worker_id}"


def hub_wake(hub_id: str) -> str:
    """Stream an API process's event hub reads beside the tasks it follows: an entry added here ends
    the hub's blocking read, so that its next one includes a task it just began to follow."""
    return f"{PREFIX}:hubwake:{hub_id}"


def replication_mark() -> str:
    """Pub/sub channel that nobody reads: an empty message published before WAIT, so that the WAIT
    covers every write made before it (see ``lmsp_core.store.connections.replicated``)."""
    return f"{PREFIX}:replicated"


def model_card(model_id: str) -> str:
    """String: the model card a worker publishes (tokenizer and chat template)."""
    return f"{PREFIX}:model:{model_id}:card"


def model_card_digest(model_id: str) -> str:
    """String: digest of the model card, so readers can tell cheaply whether it changed."""
    return f"{PREFIX}:model:{model_id}:card-digest"


def workers() -> str:
    """Sorted set: worker id -> expiry time (ms) of its last heartbeat."""
    return f"{PREFIX}:workers"


def metrics() -> str:
    """Hash: service-wide counters and histogram buckets that workers and API processes add to
    (see ``lmsp_core.store.metrics``); the API exports them at ``/metrics``."""
    return f"{PREFIX}:metrics"


def worker(worker_id: str) -> str:
    """Hash: what a worker runs (models, host, pid, started_at)."""
    return f"{PREFIX}:worker:{worker_id}"


# --- security: credentials (bearer tokens), idempotency, rate and stream limits ---------------
# Credential keys share the hash tag ``{auth}`` so that creating or revoking a token (the token and
# the index together) is one transaction on Redis Cluster too. Tokens are few; one slot is fine.


def credential(token_hash: str) -> str:
    """String: JSON of a token's record (id, principal, scopes), keyed by the SHA-256 of the token."""
    return f"{PREFIX}:{{auth}}:token:{token_hash}"


def credential_index() -> str:
    """Hash: token id -> SHA-256 of the token (for listing and revoking by id)."""
    return f"{PREFIX}:{{auth}}:tokens"


def principals() -> str:
    """Hash: principal -> JSON of its settings (weight, quotas; ``lmsp_core.store.principals``)."""
    return f"{PREFIX}:{{auth}}:principals"


def idempotency(principal: str, key_digest: str) -> str:
    """String: ``{task_id, fingerprint}`` of a principal's Idempotency-Key (digest of the key)."""
    return f"{PREFIX}:idem:{principal}:{key_digest}"


def rate(principal: str) -> str:
    """String: a principal's request count in the current fixed window (expires with the window)."""
    return f"{PREFIX}:rate:{principal}"


def streams(principal: str) -> str:
    """Sorted set: a principal's open SSE streams (member per stream, score: its lease expiry, ms)."""
    return f"{PREFIX}:streams:{principal}"


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
