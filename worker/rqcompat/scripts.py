"""The Lua scripts that touch RQ's keys, each atomic: take, take a suspect group, recover, requeue."""

# Marks this job hash as started by us. A hash of another type, or a garbage attempts field, is left alone
# (pcall): one hostile key must not abort the script after it has popped other jobs.
_MARK_STARTED_LUA = """
local function mark(jk, now, worker)
  if redis.call('TYPE', jk).ok == 'hash' then
    redis.pcall('HSET', jk, 'status', 'started', 'started_at', now, 'worker_name', worker, 'last_heartbeat', now)
    redis.pcall('HINCRBY', jk, 'kevlaya_attempts', 1)
  end
end
local function registry_ok(key)
  local t = redis.call('TYPE', key).ok
  return t == 'zset' or t == 'none'
end
"""

# KEYS: queue list, started registry, job key prefix. ARGV: n, score (expiry), exec id, worker, now string.
_TAKE_LUA = (
    _MARK_STARTED_LUA
    + """
if not registry_ok(KEYS[2]) then return redis.error_reply('KEVLAYA_BAD_REGISTRY') end
local out = {}
for i = 1, tonumber(ARGV[1]) do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  redis.call('ZADD', KEYS[2], ARGV[2], id .. ':' .. ARGV[3])
  mark(KEYS[3] .. id, ARGV[5], ARGV[4])
  out[#out + 1] = id
end
return out
"""
)

# Pops one suspect group and registers its jobs as started, atomically. Returns {record, id...}.
# KEYS: suspects list, started registry, job key prefix. ARGV: score, exec id, worker, now string.
_TAKE_GROUP_LUA = (
    _MARK_STARTED_LUA
    + """
if not registry_ok(KEYS[2]) then return redis.error_reply('KEVLAYA_BAD_REGISTRY') end
local raw = redis.call('LPOP', KEYS[1])
if not raw then return {} end
local out = {raw}
local ok, rec = pcall(cjson.decode, raw)
if not ok or type(rec) ~= 'table' or type(rec['ids']) ~= 'table' then return out end
for _, id in ipairs(rec['ids']) do
  if type(id) == 'string' then
    redis.call('ZADD', KEYS[2], ARGV[1], id .. ':' .. ARGV[2])
    mark(KEYS[3] .. id, ARGV[4], ARGV[3])
    out[#out + 1] = id
  end
end
return out
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
