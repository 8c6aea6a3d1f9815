"""The shared KV block store: tier 2, where one engine leaves KV blocks that another can pull
instead of recomputing their prefill (DESIGN §4).

A stored block is self-describing: a header says which model (by name and weights fingerprint),
which layout, which dtype and which block hash it holds, with a checksum of its payload. A reader
states what it expects (`BlockFormat`) and gets only blocks that match in every respect; anything
else is refused loudly (`BlockRefused`, logged, counted), never used. Corrupt blocks are deleted.

`BlockStore` is the interface; `RedisBlockStore` keeps blocks in Redis under a byte cap with LRU
eviction. Another tier (local disk, a dedicated store) only has to implement the same three calls.

Redis keys (S = kvharbor:blk:):
    S <model>:<layout>:<dtype>:<fingerprint>:<hash hex>   one block: header + payload
    S lru                           ZSET key -> logical clock of last use
    S sizes                         HASH key -> bytes
    S bytes / S clock / S evictions counters;  S cap  the byte cap (set by `kvharbor kvcache`)
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvharbor.common.block_hash import BlockHash, to_hex
from kvharbor.common.redis_keys import STORE_PREFIX

log = logging.getLogger("kvharbor.kvcache.store")

MAGIC = b"KVHB"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<4sBI")  # magic, version, header length
DEFAULT_CAP_BYTES = 1 << 30


class BlockStoreUnavailable(RuntimeError):
    """The store cannot answer now; the engine recomputes instead."""


class BlockRefused(ValueError):
    """A stored block that must not be used: wrong model, layout or dtype, or a bad checksum."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # fingerprint | layout | dtype | checksum | format


@dataclass(frozen=True)
class BlockFormat:
    """What a block's bytes mean: who may read them."""

    model: str
    fingerprint: str  # identity of the weights (engine/kv_transfer.py computes it)
    layout: str  # e.g. "hm1:L30:H3:D64:B16" - tensor order and shape of one block
    dtype: str  # e.g. "bfloat16"
    block_bytes: int  # payload size of one block

    def key(self, block_hash: BlockHash, prefix: str = STORE_PREFIX) -> str:
        # dtype and weights are in the key too: fleets that differ there keep apart instead of
        # refusing each other's blocks forever. The header checks still catch a wrong writer.
        return f"{prefix}{self.model}:{self.layout}:{self.dtype}:{self.fingerprint[:16]}:{to_hex(block_hash)}"


def checksum(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode_block(fmt: BlockFormat, block_hash: BlockHash, payload: bytes) -> bytes:
    if len(payload) != fmt.block_bytes:
        raise ValueError(f"a {fmt.layout} {fmt.dtype} block is {fmt.block_bytes} bytes, got {len(payload)}")
    header = json.dumps(
        {
            "model": fmt.model,
            "fingerprint": fmt.fingerprint,
            "layout": fmt.layout,
            "dtype": fmt.dtype,
            "hash": to_hex(block_hash),
            "nbytes": len(payload),
            "checksum": checksum(payload),
        },
        separators=(",", ":"),
    ).encode()
    return _HEAD.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def decode_block(fmt: BlockFormat, block_hash: BlockHash, blob: bytes) -> bytes:
    """The payload of `blob` if it is exactly the block `fmt` and `block_hash` ask for; else BlockRefused."""
    try:
        magic, version, head_len = _HEAD.unpack_from(blob)
        header = json.loads(blob[_HEAD.size : _HEAD.size + head_len])
    except (struct.error, ValueError) as exc:
        raise BlockRefused("format", f"not a kvharbor KV block: {exc}") from None
    if magic != MAGIC or version != FORMAT_VERSION or not isinstance(header, dict):
        raise BlockRefused("format", f"not a kvharbor KV block of format version {FORMAT_VERSION}")
    for field, reason in (
        ("model", "fingerprint"),
        ("fingerprint", "fingerprint"),
        ("layout", "layout"),
        ("dtype", "dtype"),
    ):
        if header.get(field) != getattr(fmt, field):
            raise BlockRefused(
                reason,
                f"block {to_hex(block_hash)} was written for {field}={header.get(field)!r}, this engine has "
                f"{getattr(fmt, field)!r}: engines sharing a store under one model name must run the same "
                "weights, dtype and block layout",
            )
    payload = blob[_HEAD.size + head_len :]
    if (
        header.get("hash") != to_hex(block_hash)
        or len(payload) != fmt.block_bytes
        or header.get("checksum") != checksum(payload)
    ):
        raise BlockRefused("checksum", f"block {to_hex(block_hash)} is corrupt (checksum or size mismatch)")
    return payload


class BlockStore(Protocol):
    async def put(self, fmt: BlockFormat, blocks: Sequence[tuple[BlockHash, bytes]]) -> int:
        """Store blocks not stored yet; returns how many were new."""

    async def get_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the longest run of `hashes`, from the first, that the store holds and that
        pass every check. A refused block ends the run (counted in `refused`)."""

    async def contains_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> int: ...

    async def stats(self) -> dict: ...


# ARGV: prefix, default cap, then key, blob pairs. Returns {stored, evicted}.
# `sizes` is the ledger: a key counts in `bytes` exactly while it has a `sizes` entry, even if the
# key itself vanished behind our back (DEL by hand, Redis maxmemory eviction).
_PUT = """
local S = ARGV[1]
local cap = tonumber(redis.call('GET', S .. 'cap') or ARGV[2])
local stored = 0
for i = 3, #ARGV, 2 do
  local k, v = ARGV[i], ARGV[i + 1]
  local tick = redis.call('INCR', S .. 'clock')
  if redis.call('EXISTS', k) == 0 then
    local stale = tonumber(redis.call('HGET', S .. 'sizes', k) or '0')
    redis.call('SET', k, v)
    redis.call('HSET', S .. 'sizes', k, #v)
    redis.call('INCRBY', S .. 'bytes', #v - stale)
    stored = stored + 1
  end
  redis.call('ZADD', S .. 'lru', tick, k)
end
local evicted = 0
while tonumber(redis.call('GET', S .. 'bytes') or '0') > cap do
  local victim = redis.call('ZPOPMIN', S .. 'lru')
  if #victim == 0 then
    redis.call('SET', S .. 'bytes', 0)
    break
  end
  local size = tonumber(redis.call('HGET', S .. 'sizes', victim[1]) or '0')
  redis.call('DEL', victim[1])
  redis.call('HDEL', S .. 'sizes', victim[1])
  redis.call('DECRBY', S .. 'bytes', size)
  evicted = evicted + 1
end
if evicted > 0 then redis.call('INCRBY', S .. 'evictions', evicted) end
return {stored, evicted}
"""

# ARGV: prefix, keys... Returns the blobs of the leading run of present keys (each touched in the LRU).
_GET_RUN = """
local S = ARGV[1]
local out = {}
for i = 2, #ARGV do
  local v = redis.call('GET', ARGV[i])
  if not v then break end
  redis.call('ZADD', S .. 'lru', redis.call('INCR', S .. 'clock'), ARGV[i])
  out[#out + 1] = v
end
return out
"""

# ARGV: prefix, key. Deletes one block and its accounting (a corrupt block).
_DROP = """
local S, k = ARGV[1], ARGV[2]
local size = tonumber(redis.call('HGET', S .. 'sizes', k) or '0')
redis.call('DEL', k)
redis.call('DECRBY', S .. 'bytes', size)
redis.call('HDEL', S .. 'sizes', k)
redis.call('ZREM', S .. 'lru', k)
return size
"""


class RedisBlockStore:
    """`BlockStore` in Redis, under a byte cap with LRU eviction (one Lua call per operation)."""

    def __init__(self, client, prefix: str = STORE_PREFIX, default_cap: int = DEFAULT_CAP_BYTES) -> None:
        self.client = client
        self._prefix = prefix
        self._default_cap = default_cap
        self._put = client.register_script(_PUT)
        self._get_run = client.register_script(_GET_RUN)
        self._drop = client.register_script(_DROP)
        self.refused: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, timeout: float = 2.0, **kwargs) -> RedisBlockStore:
        import redis.asyncio as redis

        return cls(redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout), **kwargs)

    async def _call(self, coro):
        from redis.exceptions import RedisError

        try:
            return await coro
        except (RedisError, OSError, TimeoutError) as exc:
            raise BlockStoreUnavailable(
                f"shared block store in Redis unavailable: {type(exc).__name__}: {exc}"
            ) from exc

    async def set_cap(self, cap_bytes: int) -> None:
        await self._call(self.client.set(self._prefix + "cap", cap_bytes))

    async def put(self, fmt: BlockFormat, blocks: Sequence[tuple[BlockHash, bytes]]) -> int:
        if not blocks:
            return 0
        args: list = [self._prefix, self._default_cap]
        for block_hash, payload in blocks:
            args += [fmt.key(block_hash, self._prefix), encode_block(fmt, block_hash, payload)]
        stored, _evicted = await self._call(self._put(args=args))
        return int(stored)

    async def get_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> list[bytes]:
        if not hashes:
            return []
        keys = [fmt.key(h, self._prefix) for h in hashes]
        blobs = await self._call(self._get_run(args=[self._prefix, *keys]))
        out = []
        for block_hash, key, blob in zip(hashes, keys, blobs, strict=False):
            try:
                out.append(decode_block(fmt, block_hash, blob))
            except BlockRefused as exc:
                self.refused[exc.reason] = self.refused.get(exc.reason, 0) + 1
                log.error("refused a shared KV block: %s", exc, extra={"reason": exc.reason, "key": key})
                # Our key, yet not our block: corrupt, or a misconfigured writer. Either way no
                # reader with this format can use it, so it goes.
                await self._call(self._drop(args=[self._prefix, key]))
                break
        return out

    async def contains_run(self, fmt: BlockFormat, hashes: Sequence[BlockHash]) -> int:
        if not hashes:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for h in hashes:
            pipe.exists(fmt.key(h, self._prefix))
        found = await self._call(pipe.execute())
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    async def stats(self) -> dict:
        pipe = self.client.pipeline(transaction=False)
        for name in ("bytes", "cap", "evictions"):
            pipe.get(self._prefix + name)
        pipe.zcard(self._prefix + "lru")
        used, cap, evictions, blocks = await self._call(pipe.execute())
        return {
            "bytes": int(used or 0),
            "cap_bytes": int(cap or self._default_cap),
            "blocks": int(blocks),
            "evictions": int(evictions or 0),
        }

    async def close(self) -> None:
        await self.client.aclose()
