"""Stored Responses: one tenant's conversations, in Redis (or in this process without Redis).

A record is what a continuation needs in one read: the Response, the input items it was asked
with, and the conversation before them (`context`). Continuing it sends context + input + output
again, so a turn never walks a chain of records that eviction may have broken.

The rules, the same in both stores:
- Every key carries the tenant (common/redis_keys.py response_key): another tenant's id is simply
  not there, a 404 like an unknown one.
- A record lives `ttl` seconds from its last write. A tenant's records together hold at most
  `budget` bytes: a write past it evicts that tenant's least recently written records first, and
  leaves a marker, so a continuation of an evicted response is a 404 that says why. A record
  larger than the whole budget is not kept (marker "too_large").
- A write is one Lua script on the tenant's slot (Redis Cluster too): the record, the index, the
  byte count and any eviction land together or not at all.

Records whose TTL ran out leave the byte count at the tenant's next write (and are counted then).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvharbor.common.redis_keys import response_key

GONE_REASONS = {
    "budget": "it was evicted: this tenant's stored responses passed their byte budget "
              "(response_store_budget_bytes), and the least recently written go first",
    "too_large": "it was larger than this tenant's whole byte budget for stored responses "
                 "(response_store_budget_bytes)",
}  # fmt: skip


@dataclass(frozen=True)
class Written:
    """What a write evicted: records past their TTL, records over the budget, and whether the
    record itself was too large to keep."""

    expired: int = 0
    evicted: int = 0
    too_large: bool = False


@dataclass(frozen=True)
class Found:
    record: dict[str, Any] | None
    gone: str | None = None  # why it is not there, when the store knows (a GONE_REASONS key)


# KEYS: record, index (zset id -> write sequence), sizes (hash id -> bytes), byte count, sequence.
# ARGV: id, record, ttl ms, budget bytes, record key prefix, marker key prefix. Returns {expired,
# evicted, too_large}. Every record has the same TTL, so those past it are the oldest in write order:
# the ones at the index's head whose record key is gone. The index outlives the records (twice
# their TTL) so that those are counted.
_PUT = """
local id, doc, ttl, budget = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local function forget(victim)
  local size = tonumber(redis.call('HGET', KEYS[3], victim) or '0')
  redis.call('HDEL', KEYS[3], victim)
  redis.call('ZREM', KEYS[2], victim)
  redis.call('DECRBY', KEYS[4], size)
  return size
end
local expired = 0
while true do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest or redis.call('EXISTS', ARGV[5] .. oldest) == 1 then break end
  forget(oldest)
  expired = expired + 1
end
forget(id)
if string.len(doc) > budget then
  redis.call('DEL', KEYS[1])
  redis.call('SET', ARGV[6] .. id, 'too_large', 'PX', ttl)
  return {expired, 0, 1}
end
redis.call('SET', KEYS[1], doc, 'PX', ttl)
redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), id)
redis.call('HSET', KEYS[3], id, string.len(doc))
local total = redis.call('INCRBY', KEYS[4], string.len(doc))
local evicted = 0
while total > budget do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest or oldest == id then break end
  total = total - forget(oldest)
  redis.call('DEL', ARGV[5] .. oldest)
  redis.call('SET', ARGV[6] .. oldest, 'budget', 'PX', ttl)
  evicted = evicted + 1
end
for i = 2, 5 do redis.call('PEXPIRE', KEYS[i], 2 * ttl) end
return {expired, evicted, 0}
"""

# KEYS: record, index, sizes, byte count. ARGV: id. Returns 1 if the record was there.
_DELETE = """
local existed = redis.call('DEL', KEYS[1])
local size = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if size > 0 then redis.call('DECRBY', KEYS[4], size) end
return existed
"""


def encode(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"))


class RedisResponseStore:
    """The store every gateway replica shares: turn 2 may land on another replica than turn 1."""

    def __init__(self, client: Any, ttl_s: float, budget_bytes: int) -> None:
        self.client, self.ttl_ms, self.budget = client, max(1, int(ttl_s * 1000)), budget_bytes
        self._put = client.register_script(_PUT)
        self._delete = client.register_script(_DELETE)

    @staticmethod
    def _keys(tenant: str, rid: str) -> list[str]:
        return [response_key(tenant, "r:" + rid), response_key(tenant, "idx"), response_key(tenant, "sz"),
                response_key(tenant, "bytes"), response_key(tenant, "seq")]  # fmt: skip

    async def put(self, tenant: str, rid: str, record: dict[str, Any]) -> Written:
        prefixes = [response_key(tenant, "r:"), response_key(tenant, "gone:")]
        args = [rid, encode(record), self.ttl_ms, self.budget, *prefixes]
        expired, evicted, too_large = await self._put(keys=self._keys(tenant, rid), args=args)
        return Written(int(expired), int(evicted), bool(too_large))

    async def get(self, tenant: str, rid: str) -> Found:
        doc = await self.client.get(response_key(tenant, "r:" + rid))
        if doc is not None:
            return Found(json.loads(doc))
        gone = await self.client.get(response_key(tenant, "gone:" + rid))
        return Found(None, gone.decode() if isinstance(gone, bytes) else gone)

    async def delete(self, tenant: str, rid: str) -> bool:
        return bool(await self._delete(keys=self._keys(tenant, rid), args=[rid]))


class MemoryResponseStore:
    """The same rules in this process, for a gateway without Redis (one replica: a second would
    not see these records)."""

    def __init__(self, ttl_s: float, budget_bytes: int, clock: Any = time.monotonic) -> None:
        self.ttl, self.budget, self.clock = ttl_s, budget_bytes, clock
        self._records: dict[str, OrderedDict[str, tuple[str, float]]] = {}  # tenant -> id -> (doc, written)
        self._gone: dict[tuple[str, str], tuple[str, float]] = {}  # (tenant, id) -> (reason, until)

    async def put(self, tenant: str, rid: str, record: dict[str, Any]) -> Written:
        now = self.clock()
        records = self._records.setdefault(tenant, OrderedDict())
        expired = [k for k, (_, at) in records.items() if at <= now - self.ttl]
        for k in expired:
            del records[k]
        records.pop(rid, None)
        doc = encode(record)
        if len(doc) > self.budget:
            self._gone[(tenant, rid)] = ("too_large", now + self.ttl)
            return Written(len(expired), 0, True)
        records[rid] = (doc, now)
        total, evicted = sum(len(d) for d, _ in records.values()), 0
        while total > self.budget and next(iter(records)) != rid:
            victim, (victim_doc, _) = records.popitem(last=False)
            self._gone[(tenant, victim)] = ("budget", now + self.ttl)
            total -= len(victim_doc)
            evicted += 1
        self._gone = {key: gone for key, gone in self._gone.items() if gone[1] > now}
        return Written(len(expired), evicted, False)

    async def get(self, tenant: str, rid: str) -> Found:
        now = self.clock()
        doc, at = self._records.get(tenant, {}).get(rid, (None, 0.0))
        if doc is not None and at > now - self.ttl:
            return Found(json.loads(doc))
        reason, until = self._gone.get((tenant, rid), (None, 0.0))
        return Found(None, reason if until > now else None)

    async def delete(self, tenant: str, rid: str) -> bool:
        found = await self.get(tenant, rid)
        self._records.get(tenant, {}).pop(rid, None)
        return found.record is not None
