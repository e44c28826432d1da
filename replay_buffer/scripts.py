"""Lua scripts that keep admission control atomic across every rollout worker of a job, and the trainer's
bookkeeping (COMMIT, SETTLE, DEAD_LETTER) counted once however often a client's retry sends it.

Reservations are tracked per worker (`reservations` hash) and every worker holds a lease in the
`workers` zset (score = expiry, Redis server time in ms, so worker clocks never matter). Any admission
call first reaps workers whose lease expired: their unfinished reservations go back to the pool, so a
dead generator never holds slots forever, and the prompts it had in flight (its `inflight:<worker>`
list) move to the `reissue` list, which every worker serves before sampling new prompts.

In-flight groups are also counted by the version at which they were admitted (the job's `admitted` hash,
version -> groups, and each worker's `admitted:<worker>` hash, which a dead or leaving worker's release
subtracts). `buffer.admission: oldest` anchors the cap at the oldest of them (see ADMIT).
"""

_REAP = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- A worker's in-flight admissions leave the job's per-version counts.
local function forget_admitted(admitted, aprefix, w)
  local mine = redis.call('HGETALL', aprefix .. w)
  for i = 1, #mine, 2 do
    if redis.call('HINCRBY', admitted, mine[i], -tonumber(mine[i + 1])) <= 0 then
      redis.call('HDEL', admitted, mine[i])
    end
  end
  redis.call('DEL', aprefix .. w)
end
-- A worker's answered admission calls (ADMIT's replay guard) go with it.
local function forget_calls(calls, w)
  local mine = w .. ':'
  for _, f in ipairs(redis.call('HKEYS', calls)) do
    if string.sub(f, 1, #mine) == mine then redis.call('HDEL', calls, f) end
  end
end
-- A worker's reservations go back to the pool and its in-flight prompts to the reissue list.
local function release(started, reservations, workers, reissue, stats, prefix, w, admitted, aprefix, calls)
  forget_admitted(admitted, aprefix, w)
  forget_calls(calls, w)
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
local function reap(started, reservations, workers, reissue, stats, prefix, now, admitted, aprefix, calls)
  local released = 0
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', workers, '-inf', now)) do
    released = released + release(started, reservations, workers, reissue, stats, prefix, w, admitted, aprefix,
                                  calls)
  end
  return released
end
"""

ADMIT = (
    _REAP
    + """
-- KEYS: started, reservations, workers, version, reissue, stats, admitted, admit_calls
-- ARGV: groups_per_step, max_staleness, worker, lease_ms, inflight prefix, admitted prefix, oldest (1/0),
--   caller (one of the worker's loops), call (unique per call of the worker)
-- Returns the version the slot was admitted at, or -1 when the cap is reached.
-- The cap: (base + max_staleness + 1) * groups_per_step groups started, base = the published version, or
-- with `oldest` the smaller of it and the admission version of the oldest group still in flight: groups
-- admitted later can then never overtake that one by enough steps to make it stale.
-- A call this script already granted (the client retries it with the same ARGV after losing the reply) is
-- answered again from admit_calls instead of taking a second slot that no group would ever give back.
redis.replicate_commands()
local field = ARGV[3] .. ':' .. ARGV[8]
local last = redis.call('HGET', KEYS[8], field)
if last then
  local sep = string.find(last, ':', 1, true)
  if string.sub(last, 1, sep - 1) == ARGV[9] then return tonumber(string.sub(last, sep + 1)) end
end
local now = now_ms()
reap(KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6], ARGV[5], now, KEYS[7], ARGV[6], KEYS[8])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[3])
local v = tonumber(redis.call('GET', KEYS[4]) or '0')
local base = v
if ARGV[7] == '1' then
  local counts = redis.call('HGETALL', KEYS[7])
  for i = 1, #counts, 2 do
    if tonumber(counts[i + 1]) > 0 and tonumber(counts[i]) < base then base = tonumber(counts[i]) end
  end
end
local started = tonumber(redis.call('GET', KEYS[1]) or '0')
local cap = (base + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1])
if started + 1 <= cap then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[7], v, 1)
  redis.call('HINCRBY', ARGV[6] .. ARGV[3], v, 1)
  redis.call('INCR', KEYS[1])
  redis.call('HSET', KEYS[8], field, ARGV[9] .. ':' .. v)
  return v
end
return -1
"""
)

REAP = (
    _REAP
    + """
-- KEYS: started, reservations, workers, reissue, stats, admitted, admit_calls
-- ARGV: inflight prefix, admitted prefix
redis.replicate_commands()
return reap(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], now_ms(), KEYS[6], ARGV[2], KEYS[7])
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
-- KEYS: started, reservations, workers, reissue, stats, admitted, admit_calls   ARGV: worker, inflight prefix,
-- admitted prefix (a worker leaving with groups unfinished, e.g. cancelled: their prompts are reissued too)
return release(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[2], ARGV[1], KEYS[6], ARGV[3], KEYS[7])
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

END_SLOT = """
-- KEYS: reservations, started, stats, groups, inflight:<worker>, admitted, admitted:<worker>, admit_calls
-- ARGV: worker, prompt_id ('': none), admitted_at ('': none), the caller's admit_calls field ('': none),
--   the encoded group ('': a release)
-- A reserved slot ends: `put` appends its group to the stream (the reservation became a record), `release`
-- gives the slot back. Either way the prompt is no longer in flight, nor the admission. Returns the group's
-- entry id, or 'released'. With a field (the rollout loop ADMIT granted the slot to: one admission out per
-- loop), the entry `<call>:<version>` is marked with that answer: a call the client retries after losing
-- the reply (replay_buffer/client.py) returns it again instead of storing the group twice, or counting the
-- slot out twice (a leaked slot, or one admission too many).
redis.replicate_commands()
local cur = nil
if ARGV[4] ~= '' then
  cur = redis.call('HGET', KEYS[8], ARGV[4])
  if cur then
    local done = string.match(cur, '^[^:]*:[^:]*:(.+)$')
    if done then return done end
  end
end
local out = 'released'
if ARGV[5] ~= '' then
  out = redis.call('XADD', KEYS[4], '*', 'd', ARGV[5])
  redis.call('HINCRBY', KEYS[3], 'produced', 1)
else
  redis.call('DECR', KEYS[2])
end
redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if ARGV[2] ~= '' then redis.call('LREM', KEYS[5], 1, ARGV[2]) end
-- an admission count that reaches 0 goes at once (a leftover 0 would hold `oldest` admission at its version)
if ARGV[3] ~= '' then
  for _, k in ipairs({KEYS[6], KEYS[7]}) do
    if redis.call('HINCRBY', k, ARGV[3], -1) <= 0 then redis.call('HDEL', k, ARGV[3]) end
  end
end
if cur then redis.call('HSET', KEYS[8], ARGV[4], cur .. ':' .. out) end
return out
"""

COMMIT = """
-- KEYS: commits, trained, groups, stats, staleness, lengths, ledger
-- ARGV: commit id, consumer group, the commit as JSON: {version, keep, groups: [[group_id, min_version]...],
--   entries: [entry_id...], staleness: {versions: groups}, lengths: {"trained:<tokens>": samples},
--   ledger: true/false, forget_below: version (absent: keep every trained id)}
-- One optimizer step's bookkeeping, applied once per commit id: a client whose reply was lost (Redis
-- stalled past its socket timeout) sends the same call again, and Redis runs both copies once it
-- continues; XACK and ZADD would shrug that off, the counters would not (steps = versions + 1).
-- Returns 1 when applied, 0 when this commit id had been applied already.
redis.replicate_commands()
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local c = cjson.decode(ARGV[3])
for _, g in ipairs(c.groups) do redis.call('ZADD', KEYS[2], g[2], g[1]) end
for _, id in ipairs(c.entries) do redis.call('XACK', KEYS[3], ARGV[2], id) end
redis.call('HINCRBY', KEYS[4], 'consumed', #c.entries)
redis.call('HINCRBY', KEYS[4], 'steps', 1)
if c.ledger then
  for _, g in ipairs(c.groups) do redis.call('RPUSH', KEYS[7], g[1]) end
end
for s, n in pairs(c.staleness) do redis.call('HINCRBY', KEYS[5], s, n) end
for k, n in pairs(c.lengths) do redis.call('HINCRBY', KEYS[6], k, n) end
if c.forget_below then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. c.forget_below) end
redis.call('ZADD', KEYS[1], c.version, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (c.version - c.keep))
return 1
"""

SETTLE = """
-- KEYS: groups, stats, started, recycle, lengths
-- ARGV: consumer group, entry id, counter, give the admission slot back (1/0), recycle (1/0), prompt_id,
--   lengths JSON {"stale:<tokens>": samples}
-- A group the trainer will not train (dropped as stale or from the future, skipped as a duplicate): its
-- counts go in only when this call's XACK acknowledged the entry, so a copy sent again by a client's
-- retry (or another trainer settling the same entry) counts nothing twice. Returns 1 when counted.
redis.replicate_commands()
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
if ARGV[4] == '1' then redis.call('DECR', KEYS[3]) end
if ARGV[5] == '1' then
  redis.call('RPUSH', KEYS[4], ARGV[6])
  redis.call('HINCRBY', KEYS[2], 'recycled', 1)
end
for k, n in pairs(cjson.decode(ARGV[7])) do redis.call('HINCRBY', KEYS[5], k, n) end
return 1
"""

DEAD_LETTER = """
-- KEYS: groups, dead letters, stats   ARGV: consumer group, entry id, reason, payload, maxlen
-- An entry that does not decode moves to the dead-letter stream once, as SETTLE counts once.
redis.replicate_commands()
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'entry_id', ARGV[2], 'reason', ARGV[3], 'd', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'dead_letter', 1)
return 1
"""
