"""Lua scripts that change a task's record and its event stream in one atomic step.

Each script touches only the keys of one task (one hash tag), so it runs unchanged on Redis
Cluster. Time comes from the Redis server (``TIME``), so leases do not depend on host clocks.
Events go into the stream in their stored form (``eventlog.pack``): callers pack the data.

Each script has one caller, which builds its arguments and turns its reply into a typed result:
``tasks.TaskStore`` (CLAIM, CANCEL, RENEW, RELEASE, REQUEUE), ``eventstore.EventStore`` (APPEND)
and ``taskindex.ActiveIndex`` (INDEX_ADD, INDEX_TAKE). Nothing else calls them.
"""

from lmsp_core import wire
from lmsp_core.store.eventlog import CODES

_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# logs longer than this are not rebuilt when they end (the spare space of their last node is
# negligible, and rebuilding blocks Redis for longer)
COMPACT_LIMIT = 10_000

_FINALIZE = """
local function finalize(status, response, err, event_ttl, task_ttl)
  redis.call('HSET', KEYS[1], 'status', status, 'response', response, 'finished_at', now_ms / 1000)
  if err ~= '' then redis.call('HSET', KEYS[1], 'error', err) end
  redis.call('HDEL', KEYS[1], 'lease', 'lease_until', 'cancel')
  -- rebuild the finished log with tightly sized nodes: Redis allocates every stream node at
  -- stream-node-max-bytes (4 KiB), which for a typical task's log is half its memory
  if redis.call('XLEN', KEYS[2]) <= """ + str(COMPACT_LIMIT) + """ then
    local dump = redis.call('DUMP', KEYS[2])
    if dump then redis.call('RESTORE', KEYS[2], 0, dump, 'REPLACE') end
  end
  redis.call('PEXPIRE', KEYS[2], event_ttl)
  redis.call('PEXPIRE', KEYS[3], event_ttl)
  redis.call('PEXPIRE', KEYS[1], task_ttl)
  -- a stored response (store: true) gets its final object in the same step
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('HSET', KEYS[4], 'response', response) end
end
local function add_event(id, name, data)
  redis.call('XADD', KEYS[2], '0-' .. id, 'event', name, 'data', data)
  redis.call('HSET', KEYS[1], 'last_event_id', id)
end
"""

# KEYS: task, events, tokens, stored (keys.script_keys)
# ARGV[1]: the call as one MessagePack array (one argument rather than a dozen and two an event:
#   what a call costs to pack and to parse follows its arguments): lease, first_id, token_offset,
#   lease_ttl_ms, final (true or false), status, response_json, error_json, event_ttl_ms,
#   task_ttl_ms, then the events as (event code, stored data) pairs (eventlog.pack)
# ARGV[2]: the token bytes (eventstore.pack_tokens; binary, which Redis's MessagePack reads no strings of)
# Returns {'appended', cancel_requested}; {'mismatch', last_event_id, tokens_stored} when the batch
# does not follow what is stored (already applied, or written by someone else); {'not_held'} when
# the lease is not ours. The order of the checks lets a writer recognise a batch it sent before and
# that did land. The caller is ``eventstore.EventStore``, which packs the call and types the reply
# (``reply_of``).
APPEND = (
    _NOW_MS
    + _FINALIZE
    + """
local a = cmsgpack.unpack(ARGV[1])
local held = redis.call('HMGET', KEYS[1], 'last_event_id', 'lease', 'cancel')
local last = tonumber(held[1] or '0')
local stored = redis.call('STRLEN', KEYS[3]) / 4
if a[2] ~= last + 1 or a[3] ~= stored then return {'mismatch', last, stored} end
if held[2] ~= a[1] then return {'not_held'} end
local n = (#a - 10) / 2
for i = 0, n - 1 do
  redis.call('XADD', KEYS[2], '0-' .. (last + 1 + i), 'event', a[11 + 2 * i], 'data', a[12 + 2 * i])
end
if ARGV[2] ~= '' then redis.call('APPEND', KEYS[3], ARGV[2]) end
if a[5] then
  redis.call('HSET', KEYS[1], 'last_event_id', last + n)
  finalize(a[6], a[7], a[8], a[9], a[10])
  return {'appended', 0}
end
redis.call('HSET', KEYS[1], 'last_event_id', last + n, 'lease_until', now_ms + a[4])
return {'appended', held[3] and 1 or 0}
"""
)

# KEYS: task, events, tokens, stored (keys.script_keys)
# ARGV: lease, lease_ttl_ms, max_attempts, failed_data (packed), failed_response_json, error_json,
#       event_ttl_ms, task_ttl_ms, worker_id, job_id (the arq job that claims: see REQUEUE)
# Returns {'claimed', last_event_id, attempts, cancel_requested}, {'exhausted'}, {'missing'},
# or {status} when the task is final or held by a live lease.
CLAIM = (
    _NOW_MS
    + _FINALIZE
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
local lease_until = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
if status == 'queued' or (status == 'in_progress' and lease_until < now_ms) then
  local last = tonumber(redis.call('HGET', KEYS[1], 'last_event_id') or '0')
  local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
  if attempts > tonumber(ARGV[3]) then
    add_event(last + 1, '""" + CODES[wire.FAILED] + """', ARGV[4])
    finalize('failed', ARGV[5], ARGV[6], ARGV[7], ARGV[8])
    return {'exhausted'}
  end
  if status == 'queued' then redis.call('HSET', KEYS[1], 'started_at', now_ms / 1000) end
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'lease', ARGV[1], 'lease_until', now_ms + tonumber(ARGV[2]),
             'worker', ARGV[9], 'job', ARGV[10])
  return {'claimed', last, attempts, redis.call('HEXISTS', KEYS[1], 'cancel')}
end
return {status}
"""
)

# KEYS: task, events, tokens, stored (keys.script_keys)
# ARGV: cancelled_data (packed), cancelled_response_json, event_ttl_ms, task_ttl_ms, the task's id,
#       the cancel channel of a worker without its id (keys.cancel_channel(""))
# Returns 'dequeued' for a queued task (now cancelled: its stream gets response.cancelled at once),
# 'in_progress' for a running one (flagged, and its id published to its worker, which stops it),
# the final status for a finished one, or 'missing'.
CANCEL = (
    _NOW_MS
    + _FINALIZE
    + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status == 'queued' then
  local last = tonumber(redis.call('HGET', KEYS[1], 'last_event_id') or '0')
  add_event(last + 1, '""" + CODES[wire.CANCELLED] + """', ARGV[1])
  finalize('cancelled', ARGV[2], '', ARGV[3], ARGV[4])
  return 'dequeued'
end
if status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  local worker = redis.call('HGET', KEYS[1], 'worker')
  if worker then redis.call('PUBLISH', ARGV[6] .. worker, ARGV[5]) end
end
return status
"""
)

# KEYS: task.  ARGV: lease, lease_ttl_ms.  Extends a held lease; returns 1, or 0 if not ours.
RENEW = (
    _NOW_MS
    + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', now_ms + tonumber(ARGV[2]))
return 1
"""
)

# KEYS: task.  ARGV: lease.  Gives a held task back to the queue (graceful worker shutdown).
RELEASE = """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', 0)
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
return 1
"""

# KEYS: task.  ARGV: job id prefix.  Gives a task that nobody holds (queued, or in progress with a
# lapsed lease) a fresh arq job id, ``<prefix>:<n>``, recorded as the task's current job; returns
# it, or nil when the task is held, final or missing. The caller then enqueues that job.
REQUEUE = (
    _NOW_MS
    + """
local status = redis.call('HGET', KEYS[1], 'status')
local lease_until = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
if status == 'queued' or (status == 'in_progress' and lease_until < now_ms) then
  local job = ARGV[1] .. ':' .. redis.call('HINCRBY', KEYS[1], 'requeues', 1)
  redis.call('HSET', KEYS[1], 'job', job)
  return job
end
return false
"""
)

# The index of unfinished tasks (``keys.active_tasks``): one key per script, so these run on
# Redis Cluster too; the index is kept apart from the task scripts, which touch one task's slot.

# KEYS: index.  ARGV: task id, delay_ms.  Look at the task delay_ms from now (server time).
INDEX_ADD = (
    _NOW_MS
    + """
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
return 1
"""
)

# KEYS: index.  ARGV: limit, hold_ms.  Returns {now_ms, task ids...}: up to ``limit`` entries that are
# due, each pushed hold_ms ahead so that other reapers skip it while this one looks at it.
INDEX_TAKE = (
    _NOW_MS
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, tonumber(ARGV[1]))
for _, id in ipairs(due) do redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), id) end
table.insert(due, 1, now_ms)
return due
"""
)
