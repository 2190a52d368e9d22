"""The buffer's Lua scripts: every multi-key change is one atomic script.

A crash (of the client or the server) between two commands can therefore never leave the
stream, the pending lists and the counters disagreeing. Keys are passed in KEYS (never built
inside a script), so the scripts also work where key access is checked.
"""

from __future__ import annotations

# KEYS: stream, dedup key, stats, pushed-by-version.  ARGV: payload, version, gid, capacity, ttl
# Returns {0, id} added, {1, id} duplicate, {2, ''} full.
PUSH = """
local existing = redis.call('GET', KEYS[2])
if existing then
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return {1, existing}
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[4]) then return {2, ''} end
local id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[1], 'v', ARGV[2], 'gid', ARGV[3])
redis.call('SET', KEYS[2], id, 'EX', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'pushed', 1)
redis.call('HINCRBY', KEYS[3], 'bytes_pushed', string.len(ARGV[1]))
redis.call('HINCRBY', KEYS[4], ARGV[2], 1)
return {0, id}
"""

# KEYS: stream, stats, uses, replay zset, replay-pending hash, trained-by-version.
# ARGV: group name, max_reuse, then (entry id, version, is_replay) triples.
# Only an ack of something actually pending counts, so acking twice is harmless.
ACK = """
local acked = 0
for i = 3, #ARGV, 3 do
  local id, v, rep = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local was
  if rep == '1' then was = redis.call('HDEL', KEYS[5], id)
  else was = redis.call('XACK', KEYS[1], ARGV[1], id) end
  if was == 1 then
    acked = acked + 1
    redis.call('HINCRBY', KEYS[6], v, 1)
    local uses = redis.call('HINCRBY', KEYS[3], id, 1)
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
return acked
"""

# KEYS: stream, stats, uses, replay zset, replay-pending hash, invalid stream.
# ARGV: group name, reason ('stale' | 'invalid'), then (entry id, is_replay, error) triples.
# Invalid entries are copied to the invalid stream first: dropped, never lost.
DROP = """
local n = 0
for i = 3, #ARGV, 3 do
  local id, rep, err = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local was
  if rep == '1' then was = redis.call('HDEL', KEYS[5], id)
  else was = redis.call('XACK', KEYS[1], ARGV[1], id) end
  if was == 1 then
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

# KEYS: stream, replay zset, replay-pending hash.  ARGV: count, now (ms).
# Moves the least-used replayable entries to replay-pending and returns [id, v, payload] lists.
REPLAY_TAKE = """
local ids = redis.call('ZRANGE', KEYS[2], 0, tonumber(ARGV[1]) - 1)
local out = {}
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[2], id)
  local entry = redis.call('XRANGE', KEYS[1], id, id)
  if entry[1] then
    redis.call('HSET', KEYS[3], id, ARGV[2])
    local f = entry[1][2]
    local fields = {}
    for j = 1, #f, 2 do fields[f[j]] = f[j + 1] end
    table.insert(out, {id, fields['v'], fields['g']})
  end
end
return out
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
