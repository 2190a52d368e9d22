"""The buffer's Lua scripts: every multi-key change is one atomic script.

A crash (of the client or the server) between two commands can therefore never leave the
stream, the pending lists and the counters disagreeing. Keys are passed in KEYS (never built
inside a script), so the scripts also work where key access is checked.
"""

from __future__ import annotations

STATUS_TTL_S = 600
"""How long a push's statuses and an ack's count are kept for a resend after a lost reply
(far above the few seconds of a client's retries)."""

# Payloads never pass through Lua: moving a 66 KB argument through the script engine costs
# ~4x a native XADD. A push is therefore one MULTI/EXEC (one round trip): the native XADDs of
# its groups, then ADMIT (this script, small arguments), which keeps them only if they are new
# and fit. Inside the transaction nothing else runs, so the newest n entries are the push's
# own, and a duplicate or an over-capacity push is deleted before any reader can see it.
# ADMIT is sent with EVAL, never EVALSHA: after a server restart an EVALSHA would fail with
# NOSCRIPT at EXEC time, after the XADDs had run unguarded.
#
# KEYS: stream, stats, pushed-by-version, this push's status key, then one dedup key per group
# (in XADD order).  ARGV: capacity, dedup ttl, token, status ttl, then (policy version,
# payload bytes) per group.
# A dedup key holds the token of the push that added its group, so a retry (the reply was
# lost) knows its own groups: it deletes its new copies and counts nothing twice. A push that
# found duplicates also records its statuses under its own key, read only when a group is not
# new: a retry returns them and counts those duplicates once. A push whose groups were all new
# (the common case) neither reads nor writes that key: two calls fewer in the script. Unless
# the dedup keys expire first (buffer.dedup_ttl_s below the status TTL): it is written then.
# Capacity counts the stored entries less those trained and held until a checkpoint ('held').
# Returns one status per group (0 added by this push, 1 a duplicate: pushed before, or earlier
# in this same push), or {-2} if the new groups do not fit (nothing kept, nothing recorded).
# XLEN comes first: if the stream key is not a stream, the XADDs failed and so does this,
# before writing anything.
ADMIT = """
local n = #KEYS - 4
local before = redis.call('XLEN', KEYS[1]) - n
local function delete_ours(which)
  if #which == 0 then return end
  local ours = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', n)
  for _, i in ipairs(which) do redis.call('XDEL', KEYS[1], ours[n - i + 1][1]) end
end
local function delete_all()
  local all = {}
  for i = 1, n do all[i] = i end
  delete_ours(all)
end
local status, new, drop, seen, known = {}, {}, {}, {}, false
for i = 1, n do
  local key = KEYS[i + 4]
  local v = redis.call('GET', key)
  if seen[key] then
    status[i] = 1
    drop[#drop + 1] = i
    known = true
  elseif not v then
    status[i] = 0
    new[#new + 1] = i
  else
    if v == ARGV[3] then status[i] = 0 else status[i] = 1 end
    drop[#drop + 1] = i
    known = true
  end
  seen[key] = true
end
if known then
  local done = redis.call('GET', KEYS[4])
  if done then
    for i = 1, n do status[i] = tonumber(string.sub(done, i, i)) end
    delete_all()
    return status
  end
end
local held = tonumber(redis.call('HGET', KEYS[2], 'held') or '0')
if #new > 0 and before - held + #new > tonumber(ARGV[1]) then
  delete_all()
  return {-2}
end
delete_ours(drop)
local bytes, dups = 0, 0
for _, i in ipairs(new) do
  redis.call('SET', KEYS[i + 4], ARGV[3], 'EX', ARGV[2])
  redis.call('HINCRBY', KEYS[3], ARGV[3 + 2 * i], 1)
  bytes = bytes + tonumber(ARGV[4 + 2 * i])
end
for i = 1, n do dups = dups + status[i] end
if #new > 0 then
  redis.call('HINCRBY', KEYS[2], 'pushed', #new)
  redis.call('HINCRBY', KEYS[2], 'bytes_pushed', bytes)
end
if dups > 0 then redis.call('HINCRBY', KEYS[2], 'duplicates', dups) end
if dups > 0 or tonumber(ARGV[2]) < tonumber(ARGV[4]) then
  redis.call('SET', KEYS[4], table.concat(status), 'EX', ARGV[4])
end
return status
"""

# KEYS: stream, stats, then one dedup key per group.  ARGV: capacity.
# While a push waits for room: 1 if its new groups would fit now (or it has none), else 0.
FITS = """
local new, seen = 0, {}
for i = 3, #KEYS do
  if not seen[KEYS[i]] and not redis.call('GET', KEYS[i]) then new = new + 1 end
  seen[KEYS[i]] = true
end
local held = tonumber(redis.call('HGET', KEYS[2], 'held') or '0')
if new == 0 or redis.call('XLEN', KEYS[1]) - held + new <= tonumber(ARGV[1]) then return 1 end
return 0
"""

# Shared by ACK and DROP, whose first five KEYS are stream, stats, uses, replay zset and
# replay-pending hash, and ARGV[1] the consumer group: take an entry out of its pending state
# (consumer-group PEL, or replay-pending for a replay). Returns 1 only if it was pending, so
# acking or dropping twice changes nothing. is_replay: '0' (a stream entry), '1' (a replay,
# whichever take) or a replay's take token (its replay-pending value: released only if that
# take is the one out, so a resume acking a checkpoint's replay again cannot release the
# same entry taken again after the checkpoint).
_RELEASE = """
local function release(id, is_replay)
  if is_replay == '0' then return redis.call('XACK', KEYS[1], ARGV[1], id) end
  if is_replay ~= '1' and redis.call('HGET', KEYS[5], id) ~= is_replay then return 0 end
  return redis.call('HDEL', KEYS[5], id)
end
"""

# One command for many arguments instead of one per item: inside a script each redis.call
# costs about a microsecond of server time. In chunks of 1000 (an even number, for ZADD's
# pairs): unpack() is bounded by Lua's stack (8000 values).
_IN_CHUNKS = """
local function in_chunks(command, key, items)
  for first = 1, #items, 1000 do
    redis.call(command, key, unpack(items, first, math.min(first + 999, #items)))
  end
end
"""

# KEYS: stream, stats, uses, replay zset, replay-pending hash, trained-by-version, this ack's
# status key.  ARGV: group name, max_reuse, held ('1': these were held, and 'held' drops by
# the number deleted, those HOLD counted), the ack's token (named in its status key), then
# (entry id, version, is_replay) triples.
# Only an ack of something actually pending counts, so acking twice is harmless. Counters,
# deletions and replay scores go out once per ack, not once per entry (_IN_CHUNKS): an ack of
# 8 took 28-36 us of server time instead of 34-37 us (bench/buffer.py, five runs each). An ack
# that ran records its count under its own key: sent again (its reply was lost), it returns
# that count and changes nothing. (Without it a resent ack would find nothing pending and say 0,
# or, with replay sampling, release an entry taken again meanwhile as a replay.)
ACK = (
    _RELEASE
    + _IN_CHUNKS
    + """
local done = redis.call('GET', KEYS[7])
if done then return tonumber(done) end
local acked, reused, max_reuse = 0, 0, tonumber(ARGV[2])
local by_version, replayable, delete = {}, {}, {}
for i = 5, #ARGV, 3 do
  local id, v, rep = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if release(id, rep) == 1 then
    acked = acked + 1
    by_version[v] = (by_version[v] or 0) + 1
    local uses = 1
    if max_reuse ~= 1 then uses = redis.call('HINCRBY', KEYS[3], id, 1) end
    if uses > 1 then reused = reused + 1 end
    if uses < max_reuse then
      replayable[#replayable + 1] = uses
      replayable[#replayable + 1] = id
    else
      delete[#delete + 1] = id
    end
  end
end
for v, n in pairs(by_version) do redis.call('HINCRBY', KEYS[6], v, n) end
in_chunks('ZADD', KEYS[4], replayable)
in_chunks('XDEL', KEYS[1], delete)
in_chunks('HDEL', KEYS[3], delete)
if reused > 0 then redis.call('HINCRBY', KEYS[2], 'reused', reused) end
redis.call('HINCRBY', KEYS[2], 'acked', acked)
if ARGV[3] == '1' and #delete > 0 then  -- (HOLD counted those the ack deletes)
  local held = redis.call('HINCRBY', KEYS[2], 'held', -#delete)
  if held < 0 then redis.call('HSET', KEYS[2], 'held', 0) end
end
redis.call('SET', KEYS[7], acked, 'EX', """
    + str(STATUS_TTL_S)
    + """)
return acked
"""
)

# KEYS: stats, this hold's status key, uses.  ARGV: status ttl, max_reuse, then entry ids.
# Counts as held (out of the capacity until their ack) the trained entries their ack will
# delete, by ACK's rule: every one when max_reuse is 1, else those at their last use. One
# that stays in the stream as a replay still takes its room; counted held, its room went to a
# push and the commit left the stream over capacity. The status key makes a resend (its reply
# was lost and the client retried) count nothing twice.
HOLD = """
if redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[1]) then
  local max_reuse, n = tonumber(ARGV[2]), 0
  for i = 3, #ARGV do
    local uses = 1
    if max_reuse ~= 1 then uses = tonumber(redis.call('HGET', KEYS[3], ARGV[i]) or '0') + 1 end
    if uses >= max_reuse then n = n + 1 end
  end
  if n > 0 then redis.call('HINCRBY', KEYS[1], 'held', n) end
end
return 1
"""

# KEYS: stream, stats, uses, replay zset, replay-pending hash, invalid stream, this drop's
# status key.  ARGV: group name, reason ('stale' | 'invalid'), then (entry id, is_replay,
# error) triples.
# Invalid entries are copied to the invalid stream first: dropped, never lost. Replays (groups
# already trained) are also counted apart, so that pushed groups still reconcile. As an ack,
# a drop records its count under its own key: sent again (its reply was lost and the client
# retried), it returns that count, where it would find nothing pending and say 0.
DROP = (
    _RELEASE
    + """
local done = redis.call('GET', KEYS[7])
if done then return tonumber(done) end
local n, replays = 0, 0
for i = 3, #ARGV, 3 do
  local id, rep, err = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if release(id, rep) == 1 then
    if rep == '1' then replays = replays + 1 end
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
if replays > 0 then redis.call('HINCRBY', KEYS[2], 'replays_dropped_' .. ARGV[2], replays) end
redis.call('SET', KEYS[7], n, 'EX', """
    + str(STATUS_TTL_S)
    + """)
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

# KEYS: replay zset, replay-pending hash, uses.  ARGV: now (ms), idle (ms), then the ids the
# calling consumer holds (trained, acked at its next checkpoint: never reclaimed from it).
# Replays handed to a consumer that never acked them become replayable again.
REPLAY_RECLAIM = """
local pending = redis.call('HGETALL', KEYS[2])
local held = {}
for i = 3, #ARGV do held[ARGV[i]] = true end
local n = 0
for i = 1, #pending, 2 do
  if not held[pending[i]]
     and tonumber(ARGV[1]) - tonumber(pending[i + 1]) >= tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[2], pending[i])
    redis.call('ZADD', KEYS[1], tonumber(redis.call('HGET', KEYS[3], pending[i]) or 0), pending[i])
    n = n + 1
  end
end
return n
"""
