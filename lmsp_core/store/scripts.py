"""Lua scripts that change a task's record and its event stream, or a model's fair queue, in one
atomic step.

Each script touches only the keys of one task, or of one model's fair queue (one hash tag), so it
runs unchanged on Redis Cluster. Time comes from the Redis server (``TIME``), so leases do not depend on host clocks.
Events go into the stream in their stored form (``eventlog.pack``): callers pack the data.

Each script has one caller, which builds its arguments and turns its reply into a typed result:
``tasks.TaskStore`` (CLAIM, CANCEL, RENEW, RELEASE, REQUEUE), ``eventstore.EventStore`` (APPEND)
``taskindex.ActiveIndex`` (INDEX_ADD, INDEX_TAKE) and ``fairqueue.FairQueue`` (FAIR_*). Nothing
else calls them, but for the due indexes of other stores, which add and take entries as the index
of unfinished tasks does (INDEX_ADD, INDEX_TAKE: ``batches.BatchStore``, ``webhooks.take_due``).
"""

from lmsp_core import wire

# one-letter codes of the events a task's log holds, as the scripts and ``tasks.eventlog`` store
# them; any other name is stored as it is (names with a dot never collide with a code)
CODES = {wire.CREATED: "c", wire.ITEM_ADDED: "a", wire.TEXT_DELTA: "d", wire.REASONING_DELTA: "r",
         wire.ITEM_DONE: "o", wire.COMPLETED: "C", wire.INCOMPLETE: "I", wire.FAILED: "F", wire.CANCELLED: "X"}

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

# The fair share of a model's queue between principals (``fairqueue.FairQueue`` calls these).
# KEYS: keys.fair_queue(model) (waiting, ready, state, running, jobs), in every script.
_FAIR = """
local waiting, ready, state, running, jobs = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local SEP = string.char(1)
local function lo(p) return '[' .. p .. SEP end
local function hi(p) return '(' .. p .. string.char(2) end
local function vtime() return tonumber(redis.call('HGET', state, ':v') or '0') end
local function parse(entry)
  local p, score, cost = string.match(entry, '^(.-)' .. SEP .. '(.-)' .. SEP .. '(.*)$')
  return p, score, tonumber(cost)
end
-- a principal with waiting jobs competes from its own pass, or from the virtual time if it fell
-- behind (it waited, or had nothing queued): no credit is saved up while idle
local function activate(p)
  if not redis.call('ZSCORE', ready, p) then
    redis.call('ZADD', ready, math.max(tonumber(redis.call('HGET', state, p) or '0'), vtime()), p)
  end
end
local function settle(p)
  if redis.call('ZLEXCOUNT', waiting, lo(p), hi(p)) == 0 then
    local pass = redis.call('ZSCORE', ready, p)
    if pass then
      redis.call('HSET', state, p, pass)
      redis.call('ZREM', ready, p)
    end
  end
end
"""

# ARGV: job, principal, queue score (15 digits), cost, max_queued (0: none).
# Puts a job in its principal's waiting queue. Returns 1, or 0 when the principal already has
# max_queued waiting jobs. Safe to repeat, and the reaper's way to give back a job that a worker
# picked but never started (its running entry lapsed): such a job waits again, unchecked.
FAIR_ADMIT = (
    _NOW_MS
    + _FAIR
    + """
local job = ARGV[1]
local entry = redis.call('HGET', jobs, job)
local p, score
if entry then
  p, score = parse(entry)
  if redis.call('ZSCORE', waiting, p .. SEP .. score .. SEP .. job) then return 1 end
  local lapse = redis.call('ZSCORE', running, p .. SEP .. job)
  if lapse and tonumber(lapse) > now_ms then return 1 end
  redis.call('ZREM', running, p .. SEP .. job)
else
  p, score = ARGV[2], ARGV[3]
  local limit = tonumber(ARGV[5])
  if limit > 0 and redis.call('ZLEXCOUNT', waiting, lo(p), hi(p)) >= limit then return 0 end
  redis.call('HSET', jobs, job, p .. SEP .. score .. SEP .. ARGV[4])
end
activate(p)
redis.call('ZADD', waiting, 0, p .. SEP .. score .. SEP .. job)
return 1
"""
)

# KEYS[6]: the model's arq queue.  ARGV: slots, lease_ms, settings (MessagePack map principal ->
# {weight, max_running (0: none)}; principals not in it: weight 1, no quota).
# Picks up to ``slots`` jobs: each time the head of the principal with the least pass among those
# under max_running, charged cost / weight at the pass it starts from (start-time fair queuing).
# Each picked job gets a running entry that lapses after lease_ms. A job that left the arq queue
# meanwhile (cancelled, replaced by the reaper) is forgotten. Returns the job ids.
FAIR_PICK = (
    _NOW_MS
    + _FAIR
    + """
redis.call('ZREMRANGEBYSCORE', running, '-inf', now_ms)
local settings = cmsgpack.unpack(ARGV[3])
local counts = {}
for _, member in ipairs(redis.call('ZRANGE', running, 0, -1)) do
  local p = string.match(member, '^(.-)' .. SEP)
  counts[p] = (counts[p] or 0) + 1
end
local picked = {}
local slots = tonumber(ARGV[1])
while #picked < slots do
  local chosen, pass
  local order = redis.call('ZRANGE', ready, 0, -1, 'WITHSCORES')
  for i = 1, #order, 2 do
    local limit = settings[order[i]] and settings[order[i]][2] or 0
    if limit == 0 or (counts[order[i]] or 0) < limit then
      chosen, pass = order[i], tonumber(order[i + 1])
      break
    end
  end
  if not chosen then break end
  local head = redis.call('ZRANGEBYLEX', waiting, lo(chosen), hi(chosen), 'LIMIT', 0, 1)[1]
  if head then
    redis.call('ZREM', waiting, head)
    local job = string.match(head, '^.-' .. SEP .. '.-' .. SEP .. '(.*)$')
    local entry = redis.call('HGET', jobs, job)
    if entry and redis.call('ZSCORE', KEYS[6], job) then
      local _, _, cost = parse(entry)
      local weight = settings[chosen] and settings[chosen][1] or 1
      local start = math.max(pass, vtime())
      redis.call('HSET', state, ':v', start)
      redis.call('ZADD', ready, start + cost / weight, chosen)
      redis.call('ZADD', running, now_ms + tonumber(ARGV[2]), chosen .. SEP .. job)
      counts[chosen] = (counts[chosen] or 0) + 1
      picked[#picked + 1] = job
    else
      redis.call('HDEL', jobs, job)
    end
  end
  settle(chosen)
end
return picked
"""
)

# ARGV: job, tokens used, weight, requeue (1: the job was handed back and waits again).
# A picked job ended: its principal gets back what it was charged beyond what the run used, and
# the job is forgotten, or waits again. Returns 1, or 0 for a job the fair queue does not know.
FAIR_FINISH = (
    _FAIR
    + """
local job = ARGV[1]
local entry = redis.call('HGET', jobs, job)
if not entry then return 0 end
local p, score, cost = parse(entry)
redis.call('ZREM', running, p .. SEP .. job)
local refund = (cost - tonumber(ARGV[2])) / tonumber(ARGV[3])
if refund > 0 then
  local pass = redis.call('ZSCORE', ready, p)
  if pass then
    redis.call('ZADD', ready, tonumber(pass) - refund, p)
  else
    redis.call('HSET', state, p, tonumber(redis.call('HGET', state, p) or '0') - refund)
  end
end
if ARGV[4] == '1' then
  activate(p)
  redis.call('ZADD', waiting, 0, p .. SEP .. score .. SEP .. job)
else
  redis.call('HDEL', jobs, job)
end
return 1
"""
)

# ARGV: job.  Forgets a job that left the arq queue without running (cancelled while queued, or
# replaced by the reaper). Returns 1, or 0 for a job the fair queue does not know.
FAIR_DROP = (
    _FAIR
    + """
local job = ARGV[1]
local entry = redis.call('HGET', jobs, job)
if not entry then return 0 end
local p, score = parse(entry)
redis.call('ZREM', waiting, p .. SEP .. score .. SEP .. job)
redis.call('ZREM', running, p .. SEP .. job)
redis.call('HDEL', jobs, job)
settle(p)
return 1
"""
)

# KEYS[1]: the running set (keys.fair_queue(model)[3]).  ARGV: lease_ms, members (principal SOH job).
# Renews the running entries of the jobs a worker runs; an entry that lapsed stays gone.
FAIR_RENEW = (
    _NOW_MS
    + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now_ms + tonumber(ARGV[1]), ARGV[i]) end
return #ARGV - 1
"""
)

# KEYS[6]: the model's arq queue.  ARGV: job, settings (as FAIR_PICK's).  The job's 1-based place
# in its queue if nothing else arrives: the running jobs queued before it (as the arq queue's rank
# counts them), its principal's jobs before it, and each other principal's jobs whose start tags
# come before its own (their costs taken as their head job's). False when the job is not waiting
# (picked, or unknown to the fair queue).
FAIR_POSITION = (
    _NOW_MS
    + _FAIR
    + """
local job = ARGV[1]
local entry = redis.call('HGET', jobs, job)
if not entry then return false end
local p, score, cost = parse(entry)
local member = p .. SEP .. score .. SEP .. job
if not redis.call('ZSCORE', waiting, member) then return false end
local settings = cmsgpack.unpack(ARGV[2])
local function weight(q) return settings[q] and settings[q][1] or 1 end
local own = redis.call('ZLEXCOUNT', waiting, lo(p), '(' .. member)
local v = vtime()
local tag = math.max(tonumber(redis.call('ZSCORE', ready, p) or v), v) + own * cost / weight(p)
local ahead = own
local mine = tonumber(redis.call('ZSCORE', KEYS[6], job) or '0')
for _, run in ipairs(redis.call('ZRANGEBYSCORE', running, '(' .. now_ms, '+inf')) do
  local queued = redis.call('ZSCORE', KEYS[6], string.match(run, '^.-' .. SEP .. '(.*)$'))
  if queued and tonumber(queued) < mine then ahead = ahead + 1 end
end
local order = redis.call('ZRANGE', ready, 0, -1, 'WITHSCORES')
for i = 1, #order, 2 do
  local q = order[i]
  local start = math.max(tonumber(order[i + 1]), v)
  -- q's jobs start at tags start, start + step, ...; those below ours come first, and on a tie
  -- the principal whose name sorts first (the order of the ready set)
  if q ~= p and (start < tag or (start == tag and q < p)) then
    local head = redis.call('ZRANGEBYLEX', waiting, lo(q), hi(q), 'LIMIT', 0, 1)[1]
    local head_entry = head and redis.call('HGET', jobs, string.match(head, '^.-' .. SEP .. '.-' .. SEP .. '(.*)$'))
    local step = (head_entry and select(3, parse(head_entry)) or cost) / weight(q)
    local before = q < p and math.floor((tag - start) / step) + 1 or math.ceil((tag - start) / step)
    ahead = ahead + math.min(before, redis.call('ZLEXCOUNT', waiting, lo(q), hi(q)))
  end
end
return ahead + 1
"""
)

# --- batches (``batches.BatchStore``) ---------------------------------------------------------------

# KEYS: batch, results, open.  ARGV: line, result, outcome ('completed' or 'failed'), retention_ms.
# Stores a line's result and counts it, once. Returns 1, or 0 when the line had ended before.
BATCH_RESULT = """
redis.call('SREM', KEYS[3], ARGV[1])
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
return 1
"""

# KEYS: batch.  ARGV: expected statuses (comma-separated), new status, then field, value pairs.
# Moves the batch to a status if it is in one of the expected ones. Returns 1, or 0.
BATCH_MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 0 end
local allowed = false
for expected in string.gmatch(ARGV[1], '[^,]+') do
  if expected == status then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
