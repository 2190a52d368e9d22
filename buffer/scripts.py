"""The buffer's Lua scripts: every multi-key change is one atomic script.

A crash (of the client or the server) between two commands can therefore never leave the
stream, the pending lists and the counters disagreeing. Keys are passed in KEYS (never built
inside a script), so the scripts also work where key access is checked.
"""

from __future__ import annotations

# Payloads never pass through Lua: moving a 66 KB argument through the script engine costs
# ~4x a native XADD. A push is therefore RESERVE (this script, small arguments) followed by a
# MULTI/EXEC of native XADDs that also flips each reservation to "added".
#
# KEYS: stream, stats, then one dedup key per group.  ARGV: capacity, reserve ttl, token.
# Capacity counts the stored entries less those trained and held until a checkpoint ('held').
# Returns one status per group (0 new: reserved for this token, 1 already added), or {-1} if
# another push of one of these ids is in flight, or {-2} if the groups do not fit.
RESERVE = """
local n = #KEYS - 2
local status = {}
local new = 0
for i = 1, n do
  local v = redis.call('GET', KEYS[i + 2])
  if (not v) or v == ARGV[3] then
    status[i] = 0
    new = new + 1
  elseif string.sub(v, 1, 2) == 'r:' then
    return {-1}
  else
    status[i] = 1
  end
end
local held = tonumber(redis.call('HGET', KEYS[2], 'held') or '0')
if new > 0 and redis.call('XLEN', KEYS[1]) - held + new > tonumber(ARGV[1]) then return {-2} end
for i = 1, n do
  if status[i] == 0 then redis.call('SET', KEYS[i + 2], ARGV[3], 'EX', ARGV[2]) end
end
if n > new then redis.call('HINCRBY', KEYS[2], 'duplicates', n - new) end
return status
"""

# Shared by ACK and DROP, whose first five KEYS are stream, stats, uses, replay zset and
# replay-pending hash, and ARGV[1] the consumer group: take an entry out of its pending state
# (consumer-group PEL, or replay-pending for a replay). Returns 1 only if it was pending, so
# acking or dropping twice changes nothing.
_RELEASE = """
local function release(id, is_replay)
  if is_replay == '1' then return redis.call('HDEL', KEYS[5], id) end
  return redis.call('XACK', KEYS[1], ARGV[1], id)
end
"""

# KEYS: stream, stats, uses, replay zset, replay-pending hash, trained-by-version.
# ARGV: group name, max_reuse, held ('1': these were counted in 'held', which drops by the
# number acked), then (entry id, version, is_replay) triples.
# Only an ack of something actually pending counts, so acking twice is harmless.
ACK = (
    _RELEASE
    + """
local acked = 0
for i = 4, #ARGV, 3 do
  local id, v, rep = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if release(id, rep) == 1 then
    acked = acked + 1
    redis.call('HINCRBY', KEYS[6], v, 1)
    local uses = 1
    if ARGV[2] ~= '1' then uses = redis.call('HINCRBY', KEYS[3], id, 1) end
    if uses > 1 then redis.call('HINCRBY', KEYS[2], 'reused', 1) end
    if uses < tonumber(ARGV[2]) then
      redis.call('ZADD', KEYS[4], uses, id)
    else
      redis.call('XDEL', KEYS[1], id)
      redis.call('HDEL', KEYS[3], id)
    end
  end
end
redis.call('HINCRBY', KEYS[2], 'acked', acked)
if ARGV[3] == '1' and acked > 0 then
  local held = redis.call('HINCRBY', KEYS[2], 'held', -acked)
  if held < 0 then redis.call('HSET', KEYS[2], 'held', 0) end
end
return acked
"""
)

# KEYS: stream, stats, uses, replay zset, replay-pending hash, invalid stream.
# ARGV: group name, reason ('stale' | 'invalid'), then (entry id, is_replay, error) triples.
# Invalid entries are copied to the invalid stream first: dropped, never lost.
DROP = (
    _RELEASE
    + """
local n = 0
for i = 3, #ARGV, 3 do
  local id, rep, err = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if release(id, rep) == 1 then
    if ARGV[2] == 'invalid' then
      local entry = redis.call('XRANGE', KEYS[1], id, id)
      if entry[1] then
        redis.call('XADD', KEYS[6], '*', 'source_id', id, 'error', err, unpack(entry[1][2]))
      end
    end
    redis.call('XDEL', KEYS[1], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('ZREM', KEYS[4], id)
    n = n + 1
  end
end
redis.call('HINCRBY', KEYS[2], 'dropped_' .. ARGV[2], n)
return n
"""
)

# KEYS: replay zset, replay-pending hash.  ARGV: count, now (ms).
# Moves the least-used replayable entries to replay-pending and returns their ids (the client
# then reads the payloads with XRANGE, outside Lua).
REPLAY_TAKE = """
local ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  redis.call('HSET', KEYS[2], id, ARGV[2])
end
return ids
"""

# KEYS: replay zset, replay-pending hash, uses.  ARGV: now (ms), idle (ms).
# Replays handed to a consumer that never acked them become replayable again.
REPLAY_RECLAIM = """
local pending = redis.call('HGETALL', KEYS[2])
local n = 0
for i = 1, #pending, 2 do
  if tonumber(ARGV[1]) - tonumber(pending[i + 1]) >= tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[2], pending[i])
    redis.call('ZADD', KEYS[1], tonumber(redis.call('HGET', KEYS[3], pending[i]) or 0), pending[i])
    n = n + 1
  end
end
return n
"""
