"""Lua scripts that keep admission control atomic across every rollout worker of a job.

Reservations are tracked per worker (`reservations` hash) and every worker holds a lease in the
`workers` zset (score = expiry, Redis server time in ms, so worker clocks never matter). Any admission
call first reaps workers whose lease expired: their unfinished reservations go back to the pool, so a
dead generator never holds slots forever, and the prompts it had in flight (its `inflight:<worker>`
list) move to the `reissue` list, which every worker serves before sampling new prompts.
"""

_REAP = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- A worker's reservations go back to the pool and its in-flight prompts to the reissue list.
local function release(started, reservations, workers, reissue, stats, prefix, w)
  local n = tonumber(redis.call('HGET', reservations, w) or '0')
  if n ~= 0 then redis.call('DECRBY', started, n) end
  redis.call('HDEL', reservations, w)
  redis.call('ZREM', workers, w)
  local prompts = redis.call('LRANGE', prefix .. w, 0, -1)
  if #prompts > 0 then
    redis.call('RPUSH', reissue, unpack(prompts))
    redis.call('HINCRBY', stats, 'reissued', #prompts)
    redis.call('DEL', prefix .. w)
  end
  return n
end
local function reap(started, reservations, workers, reissue, stats, prefix, now)
  local released = 0
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', workers, '-inf', now)) do
    released = released + release(started, reservations, workers, reissue, stats, prefix, w)
  end
  return released
end
"""

ADMIT = (
    _REAP
    + """
-- KEYS: started, reservations, workers, version, reissue, stats
-- ARGV: groups_per_step, max_staleness, worker, lease_ms, inflight prefix
redis.replicate_commands()
local now = now_ms()
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6], ARGV[5], now)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[3])
local v = tonumber(redis.call('GET', KEYS[4]) or '0')
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local cap = (v + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1])
if started + 1 <= cap then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return redis.call('INCR', KEYS[1])
end
return 0
"""
)

REAP = (
    _REAP
    + """
-- KEYS: started, reservations, workers, reissue, stats   ARGV: inflight prefix
redis.replicate_commands()
return reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], now_ms())
"""
)

HEARTBEAT = """
-- KEYS: workers   ARGV: worker, lease_ms
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
"""

LEAVE = (
    _REAP
    + """
-- KEYS: started, reservations, workers, reissue, stats   ARGV: worker, inflight prefix
-- (a worker leaving with groups unfinished, e.g. cancelled: their prompts are reissued too)
return release(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[2], ARGV[1])
"""
)

REWIND = """
-- KEYS: version, started   ARGV: to_version, groups_per_step
-- The trainer resumed from a checkpoint older than the published version (it died and lost the steps in
-- between): those steps' groups were trained into weights that are gone, and the steps will be trained
-- again on new groups, so their admission slots are given back; otherwise the cap
-- (version + max_staleness + 1) * groups_per_step would stay below what was already started.
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local to = tonumber(ARGV[1])
if cur > to then redis.call('DECRBY', KEYS[2], (cur - to) * tonumber(ARGV[2])) end
redis.call('SET', KEYS[1], to)
return cur - to
"""
