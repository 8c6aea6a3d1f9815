"""The KV index's Lua scripts (kvcache_service/redis_index.py runs them), and the block shard
layout they implement. Each runs on one slot: an instance's keys, or one block shard's.
"""

from __future__ import annotations

from kvharbor.common.block_hash import DIGEST_SIZE
from kvharbor.common.redis_client import Script

# Block shards per (model, tier): a cluster lookup runs one script per shard (16 measured 2.0 ms
# p99 against 8's 1.8 at 1,000 engines on 3 masters), and one model's index spreads over at most
# this many slots per tier.
SHARDS = 8
# Buckets per shard: hash bytes 2 and 3, raw, are the bucket key's suffix (65,536 buckets). Small
# hashes stay in Redis's compact encoding (up to 128 fields of <= 64 bytes, hash-max-listpack-*),
# about 30 bytes a field instead of about 90 in a hash table. At 10M distinct blocks a bucket holds
# ~19 fields: an HGET scans half of what 32,768 buckets made it scan (3.6 us a read measured there
# on a 2-core EPYC VM), for ~2 more bytes an entry of key overhead. The raw bytes, not a number:
# formatting a number in Lua cost more than the read (1.2 us a block). Beyond ~20M distinct
# blocks per model and tier, buckets grow into hash tables.
BUCKET_BYTES = 2

# Shared by the instance scripts. KEYS: st, pend, own, lease, then the block logs of tier d and of
# tier s. Every key is the instance's (one slot). A log is the instance's stored and removed
# hashes in order, as entries of: op ('+'/'-'), count (2 bytes), that many 16-byte hashes; it is
# appended to (cheap) and read only to drop everything, or to fold it up when it grew long.
_LUA_INSTANCE = """
local ST, PEND, OWN, LEASE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local LOGS = {d = KEYS[5], s = KEYS[6]}
local records = {}
local function record(op, t, holder, blob)
  if #blob > 0 then records[#records + 1] = op .. t .. holder .. blob end
end
-- Consecutive events of one op, tier and holder go to the log and the shards as one entry and one
-- record: most events carry one hash, and an APPEND, a record and a pending field per event
-- were most of the intake's Redis time. Order is kept, so a block's ops stay in sequence.
local run_op, run_t, run_holder, run_parts = nil, nil, nil, {}
local function log(t, op, blob)
  for j = 1, #blob, 16 * 65535 do
    local part = string.sub(blob, j, j + 16 * 65535 - 1)
    local n = #part / 16
    redis.call('APPEND', LOGS[t], op .. string.char(math.floor(n / 256), n % 256) .. part)
  end
end
-- What a tier's log says the instance holds now, in the order it was stored (set semantics, as
-- the block shards keep it).
local function held(t)
  local text = redis.call('GET', LOGS[t]) or ''
  local has, order, pos = {}, {}, 1
  while pos < #text do
    local op = string.sub(text, pos, pos)
    local n = string.byte(text, pos + 1) * 256 + string.byte(text, pos + 2)
    pos = pos + 3
    for _ = 1, n do
      local h = string.sub(text, pos, pos + 15)
      pos = pos + 16
      if op == '+' then
        if not has[h] then order[#order + 1] = h end
        has[h] = true
      else
        has[h] = nil
      end
    end
  end
  local out = {}
  for _, h in ipairs(order) do if has[h] then out[#out + 1] = h has[h] = nil end end
  return out
end
local function flush()
  if run_op then
    local blob = table.concat(run_parts)
    log(run_t, run_op, blob)
    record(run_op, run_t, run_holder, blob)
    run_op, run_parts = nil, {}
  end
end
local function add(op, t, holder, blob)
  if op ~= run_op or t ~= run_t or holder ~= run_holder then
    flush()
    run_op, run_t, run_holder = op, t, holder
  end
  run_parts[#run_parts + 1] = blob
end
local function drop_all(holder)
  flush()
  for _, t in ipairs({'d', 's'}) do
    record('x', t, holder, table.concat(held(t)))  -- 'x': remove, and count it
    redis.call('DEL', LOGS[t])
  end
end
-- A log that grew to twice what the instance holds (and past 64 KiB) is folded up.
local function compact(t)
  flush()
  local size = redis.call('STRLEN', LOGS[t])
  local n = tonumber(redis.call('HGET', ST, 'n:' .. t) or '0')
  if size >= 65536 and size > 2 * (16 * n + 3) then
    local keep = table.concat(held(t))
    redis.call('DEL', LOGS[t])
    log(t, '+', keep)
  end
end
local function write_pending()
  if #records == 0 then return {} end
  local fields = {'token', ARGV[1]}
  for k, rec in ipairs(records) do
    fields[#fields + 1] = string.format('e%08d', k)
    fields[#fields + 1] = rec
  end
  redis.call('HSET', PEND, unpack(fields))
  return records
end
"""

# ARGV: token, stream ('' = unpositioned), fence owner ('' = none), then per event:
#       entry id, lease, holder id, type, tier letter, hashes blob
# Returns {applied, dropped holder or '', record, ...} (a record: op, tier, holder, hashes);
# {-1} fence lost; {-2} a pending record must be replayed first.
APPLY = Script(
    _LUA_INSTANCE
    + """
local stream, owner = ARGV[2], ARGV[3]
if owner ~= '' and redis.call('GET', OWN) ~= owner then return {-1} end
if redis.call('EXISTS', PEND) == 1 then return {-2} end
local cfield = 'cursor:' .. stream
local cursor = false
if stream ~= '' then cursor = redis.call('HGET', ST, cfield) end
local function pos(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local cms, cseq  -- the cursor's position, parsed once
if cursor then cms, cseq = pos(cursor) end
local live_lease = redis.call('GET', LEASE)
local cur = redis.call('HMGET', ST, 'lease', 'holder')
local applied, dropped, i, removed = 0, '', 4, {}
while i <= #ARGV do
  local id, lease, holder, typ, t, blob = ARGV[i], ARGV[i+1], ARGV[i+2], ARGV[i+3], ARGV[i+4], ARGV[i+5]
  i = i + 6
  local fresh, ms, seq = true, nil, nil
  if id ~= '' then
    ms, seq = pos(id)
    fresh = not cms or ms > cms or (ms == cms and seq > cseq)
  end
  if fresh and (not live_lease or live_lease == lease) then
    if cur[1] ~= lease then
      if cur[1] then drop_all(cur[2]) dropped = cur[2] end
      redis.call('HSET', ST, 'lease', lease, 'holder', holder)
      cur = {lease, holder}
    end
    if typ == 'stored' then
      add('+', t, holder, blob)
    elseif typ == 'removed' then
      add('-', t, holder, blob)
      removed[t] = true
    else
      drop_all(holder)
    end
    applied = applied + 1
  end
  -- Stale events (another life's lease) are consumed too: the cursor moves past them.
  if id ~= '' and fresh then cursor, cms, cseq = id, ms, seq end
end
flush()
for t in pairs(removed) do compact(t) end
if stream ~= '' and cursor then redis.call('HSET', ST, cfield, cursor) end
local out = write_pending()
table.insert(out, 1, dropped)
table.insert(out, 1, applied)
return out
"""
)

# ARGV: token, mode ('sweep': only if the lease lapsed; 'forget': always, then tombstone),
#       tombstone lease, tombstone ttl ms. Returns {1 dropped | 0 not, holder, record, ...}
#       or {-2} when a pending record must be replayed first.
DROP = Script(
    _LUA_INSTANCE
    + """
local mode = ARGV[2]
if redis.call('EXISTS', PEND) == 1 then return {-2} end
local cur = redis.call('HMGET', ST, 'lease', 'holder')
local known = cur[1] ~= false and cur[1] ~= nil
if mode == 'sweep' and (not known or redis.call('GET', LEASE) == cur[1]) then return {0, ''} end
if known then
  drop_all(cur[2])
  redis.call('HDEL', ST, 'lease', 'holder', 'n:d', 'n:s')
end
if mode == 'forget' then redis.call('SET', LEASE, ARGV[3], 'PX', tonumber(ARGV[4])) end
local out = write_pending()
table.insert(out, 1, cur[2] or '')
table.insert(out, 1, known and 1 or 0)
return out
"""
)

# KEYS: pend, st. ARGV: token, blocks gained in tier d, in tier s. Deletes the pending record if
# it is still the one with this token, and counts what the shards said changed (exact, unlike the
# logs: a block stored twice is held once).
DONE = Script(
    """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
for k, t in ipairs({'d', 's'}) do
  local n = tonumber(ARGV[k + 1])
  if n ~= 0 then redis.call('HINCRBY', KEYS[2], 'n:' .. t, n) end
end
return 1
"""
)

# The bucket of a block inside its shard: hash bytes 2 and 3 (byte 1 picked the shard).
_LUA_BUCKET = f"""
local function bucket(h)
  return string.sub(h, 2, {1 + BUCKET_BYTES})
end
"""

# KEYS: the shard's anchor (routes the call; every bucket key carries the shard's tag).
# ARGV: bucket key prefix, then records in order: op ('+' store, '-' or 'x' remove: 'x' when the
# instance drops everything), 8-byte holder id, 16-byte hashes. Returns, per record, the blocks it
# added (or, negative, removed).
SHARD = Script(
    _LUA_BUCKET
    + """
local P = ARGV[1]
local function find(v, h)
  local s = 1
  while true do
    local i = string.find(v, h, s, true)
    if not i then return nil end
    if (i - 1) % 8 == 0 then return i end
    s = i + 1
  end
end
local changed = {}
for a = 2, #ARGV do
  local rec = ARGV[a]
  local op, holder = string.sub(rec, 1, 1), string.sub(rec, 2, 9)
  local n = 0
  for j = 10, #rec, 16 do
    local h = string.sub(rec, j, j + 15)
    local K = P .. bucket(h)
    if op == '+' then
      -- A block nobody held yet (the common case) costs one call.
      if redis.call('HSETNX', K, h, holder) == 1 then
        n = n + 1
      else
        local v = redis.call('HGET', K, h)
        if not find(v, holder) then redis.call('HSET', K, h, v .. holder) n = n + 1 end
      end
    else
      local v = redis.call('HGET', K, h)
      local at = v and find(v, holder)
      if at then
        v = string.sub(v, 1, at - 1) .. string.sub(v, at + 8)
        if v == '' then redis.call('HDEL', K, h) else redis.call('HSET', K, h, v) end
        n = n - 1
      end
    end
  end
  changed[#changed + 1] = n
end
return changed
"""
)


# KEYS: the shards' anchors (all SHARDS, in order, on a single Redis; the one shard read, on a
# cluster). ARGV: '1' to stop at the first block nobody holds, then the chain's 16-byte hashes as
# one string: one argument instead of two per block (a bucket key and a field) took the client's
# packing and Redis's parsing out of a 256-block lookup. Returns runs: the index (from 0) where
# the holders change and the new holders ('' for none), pair after pair, then how many blocks it
# read. A shared prefix's blocks all have the same holders, so a popular prompt's reply is a few
# runs, not a value a block. Per block this does one HGET and two string builds, no more:
# on a 2-core EPYC VM a block cost 8 us (3.6 of them the HGET) with a number formatted into the key
# and a table entry a block. The bucket comes from `_LUA_BUCKET`, as the writes' does: one rule
# for both sides (inlined it saved 0.1-0.15 us a block, ~2% of a lookup's Redis time, not worth
# a second copy that could drift).
READ = Script(
    _LUA_BUCKET
    + f"""
local call, sub, byte = redis.call, string.sub, string.byte
local stop, chain, one = ARGV[1] == '1', ARGV[2], #KEYS == 1
local anchors = {{}}
for k = 1, #KEYS do anchors[k] = KEYS[k] .. ':' end
local out, n, last, read = {{}}, 0, nil, 0
for j = 1, #chain, {DIGEST_SIZE} do
  local h = sub(chain, j, j + {DIGEST_SIZE - 1})
  local anchor = one and anchors[1] or anchors[byte(h, 1) % {SHARDS} + 1]
  local v = call('HGET', anchor .. bucket(h), h)
  if not v then
    if stop then break end
    v = ''
  end
  if v ~= last then
    out[n + 1], out[n + 2], n, last = read, v, n + 2, v
  end
  read = read + 1
end
out[n + 1] = read
return out
"""
)
