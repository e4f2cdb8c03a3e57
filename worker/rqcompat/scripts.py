"""The Lua scripts that touch RQ's keys, each atomic: take (sharing a queue's tail), take a suspect group, recover,
requeue."""

from worker.rqcompat.decode import TAKEN_FIELD

# Marks this job hash as started by us, naming the started entry that holds it (TAKEN_FIELD). A hash of another
# type, or a garbage attempts field, is left alone (pcall): one hostile key must not abort the script after it has
# popped other jobs.
# A job id can be queued while a take still holds it (pushed twice, `rq requeue` of a job that runs, a copy left in
# another lane's queue): that copy is dropped, or the job ran twice. It is held while the entry its hash names still
# stands in a started registry (`regs`: every queue's, passed after a script's own KEYS; producers cannot write
# them). The hash's own fields prove nothing (any writer can set `status`): a forged name of another job's entry, or
# of an entry gone, holds nothing, so no edit of a hash can keep its job from running.
_MARK_STARTED_LUA = """
local function mark(jk, now, worker, member)
  if redis.call('TYPE', jk).ok == 'hash' then
    redis.pcall('HSET', jk, 'status', 'started', 'started_at', now, 'worker_name', worker, 'last_heartbeat', now,
      'TAKEN_FIELD', member)
    redis.pcall('HINCRBY', jk, 'kevlaya_attempts', 1)
  end
end
local function registry_ok(key)
  local t = redis.call('TYPE', key).ok
  return t == 'zset' or t == 'none'
end
local function zsets(keys, from)
  local out = {}
  for i = from, #keys do
    if redis.call('TYPE', keys[i]).ok == 'zset' then out[#out + 1] = keys[i] end
  end
  return out
end
local function held_now(jk, id, regs)
  if redis.call('TYPE', jk).ok ~= 'hash' then return false end
  local member = redis.call('HGET', jk, 'TAKEN_FIELD')
  if not member or string.sub(member, 1, #id + 1) ~= id .. ':' then return false end
  for _, reg in ipairs(regs) do
    if redis.call('ZSCORE', reg, member) then return true end
  end
  return false
end
-- One popped job into the take (registered started, marked) or, held by a take now, among the dropped.
local function start_or_drop(id, prefix, regs, registry, score, exec, now, worker, ids, dropped)
  if held_now(prefix .. id, id, regs) then
    dropped[#dropped + 1] = id
    return
  end
  local member = id .. ':' .. exec
  redis.call('ZADD', registry, score, member)
  mark(prefix .. id, now, worker, member)
  ids[#ids + 1] = id
end
-- A take script's answer: {head, n dropped, dropped id..., id...}.
local function taken(head, ids, dropped)
  local out = {head, #dropped}
  for _, id in ipairs(dropped) do out[#out + 1] = id end
  for _, id in ipairs(ids) do out[#out + 1] = id end
  return out
end
""".replace("TAKEN_FIELD", TAKEN_FIELD)

# worker.tail's rule, which stays its one definition: the take script applies it where it pops, and
# tests/test_supervisor.py checks the two agree. Lua numbers are doubles: ceil of a quotient of integers is exact
# far beyond any queue's depth.
_TAIL_TAKE_LUA = """
local function tail_take(capacity, depth, peers)
  if capacity <= 0 or peers <= 0 or depth >= capacity * (1 + peers) then return capacity end
  return math.max(1, math.ceil(depth / (1 + peers)))
end
"""

# The idle set (Keys.idle_workers: workers between takes) as a take sees it. Peers count only while their
# heartbeat in the live set (Keys.workers) is at or after live_since. A key of another type only turns sharing
# off, and is left for its owner to set right.
_IDLE_LUA = """
local function is_zset(key)
  return redis.call('TYPE', key).ok == 'zset'
end
local function idle_peers(live, idle, me, live_since)
  if not (is_zset(live) and is_zset(idle)) then return 0 end
  local n = 0
  for _, name in ipairs(redis.call('ZRANGE', idle, 0, -1)) do
    local beat = redis.call('ZSCORE', live, name)
    if name ~= me and beat and tonumber(beat) >= live_since then n = n + 1 end
  end
  return n
end
local function live_peers(live, me, live_since)
  if not is_zset(live) then return 0 end
  local n = redis.call('ZCOUNT', live, live_since, '+inf')
  local beat = redis.call('ZSCORE', live, me)
  if beat and tonumber(beat) >= live_since then n = n - 1 end
  return n
end
local function leave_idle(idle, me)
  if is_zset(idle) then redis.call('ZREM', idle, me) end
end
"""

# Takes this worker's share of a queue: the share (from the queue's depth and the live idle peers), the pop, the
# started registry and leaving the idle set are one step. Decided before the script, a peer taking in between
# left a stale depth and still counted as idle: the take came out a quarter, not a half. A copy of a job a take
# holds now is popped and dropped (`held_now`), not counted in the take (as many such as the take's rows, at most,
# a call). Returns {limit, n dropped, dropped id..., id...}.
# KEYS: queue list, started registry, job key prefix, live workers, idle workers, then every started registry.
# ARGV: capacity, score (expiry), exec id, worker, now string, live since ('': share with nobody), '1' for a take
# ahead (worker.ahead): nothing while a live peer is idle, who would run those jobs now, nor, beside busy live
# peers, while the queue holds less than a take for each worker (near its end a peer would idle meanwhile).
_TAKE_LUA = (
    _MARK_STARTED_LUA
    + _TAIL_TAKE_LUA
    + _IDLE_LUA
    + """
if not registry_ok(KEYS[2]) then return redis.error_reply('KEVLAYA_BAD_REGISTRY') end
local peers = 0
if ARGV[6] ~= '' then peers = idle_peers(KEYS[4], KEYS[5], ARGV[4], tonumber(ARGV[6])) end
if ARGV[7] == '1' then
  if peers > 0 then return {0, 0} end
  local others = live_peers(KEYS[4], ARGV[4], tonumber(ARGV[6]))
  if others > 0 and redis.call('LLEN', KEYS[1]) < tonumber(ARGV[1]) * (1 + others) then return {0, 0} end
end
local limit = tail_take(tonumber(ARGV[1]), redis.call('LLEN', KEYS[1]), peers)
local regs = zsets(KEYS, 6)
local ids, dropped = {}, {}
while #ids < limit and #dropped < limit do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  start_or_drop(id, KEYS[3], regs, KEYS[2], ARGV[2], ARGV[3], ARGV[5], ARGV[4], ids, dropped)
end
if #ids > 0 then leave_idle(KEYS[5], ARGV[4]) end
return taken(limit, ids, dropped)
"""
)

# The live idle peers of a worker (as a take counts them). KEYS: live workers, idle workers. ARGV: worker, live since.
_IDLE_PEERS_LUA = _IDLE_LUA + "return idle_peers(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]))"

# Pops one suspect group, registers its jobs as started and leaves the idle set, atomically; a job a take holds now
# is dropped from it (as in the take). Returns {record, n dropped, dropped id..., id...}.
# KEYS: suspects list, started registry, job key prefix, idle workers, then every started registry.
# ARGV: score, exec id, worker, now string.
_TAKE_GROUP_LUA = (
    _MARK_STARTED_LUA
    + _IDLE_LUA
    + """
if not registry_ok(KEYS[2]) then return redis.error_reply('KEVLAYA_BAD_REGISTRY') end
local raw = redis.call('LPOP', KEYS[1])
if not raw then return {} end
local ok, rec = pcall(cjson.decode, raw)
if not ok or type(rec) ~= 'table' or type(rec['ids']) ~= 'table' then return {raw, 0} end
local regs = zsets(KEYS, 5)
local ids, dropped = {}, {}
for _, id in ipairs(rec['ids']) do
  if type(id) == 'string' then
    start_or_drop(id, KEYS[3], regs, KEYS[2], ARGV[1], ARGV[2], ARGV[4], ARGV[3], ids, dropped)
  end
end
if #ids > 0 then leave_idle(KEYS[4], ARGV[3]) end
return taken(raw, ids, dropped)
"""
)

# A dead take's entries become suspect groups, all or nothing: if another worker claimed any entry first,
# nothing changes (it handles them). KEYS: started registry, suspects list, job key prefix.
# ARGV: n members, members..., n ids, (id, crashes)..., group records...
_RECOVER_LUA = """
local n = tonumber(ARGV[1])
for i = 2, n + 1 do
  if not redis.call('ZSCORE', KEYS[1], ARGV[i]) then return 0 end
end
for i = 2, n + 1 do redis.call('ZREM', KEYS[1], ARGV[i]) end
local m = tonumber(ARGV[n + 2])
local pos = n + 3
for _ = 1, m do
  local jk = KEYS[3] .. ARGV[pos]
  if redis.call('TYPE', jk).ok == 'hash' then
    redis.pcall('HSET', jk, 'status', 'queued', 'kevlaya_crashes', ARGV[pos + 1])
  end
  pos = pos + 2
end
for i = #ARGV, pos, -1 do redis.call('LPUSH', KEYS[2], ARGV[i]) end
return 1
"""

# Entries of our own that lost their heartbeat (Redis failed mid-write): back to the queue front, no crash.
# KEYS: started registry, queue list, job key prefix. ARGV: (member, id)...
_REQUEUE_LUA = """
local qt = redis.call('TYPE', KEYS[2]).ok
if qt ~= 'list' and qt ~= 'none' then return redis.error_reply('KEVLAYA_BAD_QUEUE') end
for i = 1, #ARGV, 2 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    local jk = KEYS[3] .. ARGV[i + 1]
    if redis.call('TYPE', jk).ok == 'hash' then redis.pcall('HSET', jk, 'status', 'queued') end
    redis.call('LPUSH', KEYS[2], ARGV[i + 1])
  end
end
return 1
"""

# Moves one id from RQ's intermediate list back to the front of its queue, atomically.
# KEYS: intermediate list, queue list, job key prefix. ARGV: id.
_UNSTICK_LUA = """
local qt = redis.call('TYPE', KEYS[2]).ok
if qt ~= 'list' and qt ~= 'none' then return redis.error_reply('KEVLAYA_BAD_QUEUE') end
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
local jk = KEYS[3] .. ARGV[1]
if redis.call('TYPE', jk).ok == 'hash' then redis.pcall('HSET', jk, 'status', 'queued') end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
"""

# A take's jobs marked done in their RQ hashes, in one call (a pipeline of 3 commands a job cost Redis ~3x the
# time). A job key of another type fails only its own commands (pcall). KEYS: job key prefix. ARGV: ended_at,
# ttl seconds, the failed-flag field, then (id, compressed error or '' for finished) a job.
_FINISH_LUA = """
for i = 4, #ARGV, 2 do
  local jk = KEYS[1] .. ARGV[i]
  if ARGV[i + 1] == '' then
    redis.pcall('HSET', jk, 'status', 'finished', 'ended_at', ARGV[1])
    redis.pcall('HDEL', jk, ARGV[3])
  else
    redis.pcall('HSET', jk, 'status', 'failed', 'ended_at', ARGV[1], 'exc_info', ARGV[i + 1], ARGV[3], '1')
  end
  redis.pcall('EXPIRE', jk, ARGV[2])
end
return 1
"""
