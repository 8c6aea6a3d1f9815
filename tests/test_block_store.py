"""The shared KV block store on a real redis-server: runs, LRU under a byte cap, and refusals."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from kvharbor.common.block_hash import block_hashes
from kvharbor.kvcache_service.block_store import (
    BlockFormat,
    BlockRefused,
    BlockStoreUnavailable,
    RedisBlockStore,
    decode_block,
    encode_block,
)

FMT = BlockFormat(model="m", fingerprint="fp-1", layout="hm1:L2:H1:D4:B4", dtype="bfloat16", block_bytes=64)
HASHES = block_hashes(list(range(40)), 4, "m")  # 10 blocks


def payload(i: int) -> bytes:
    return bytes([i % 256]) * FMT.block_bytes


def run(redis_url: str, body, **store_kwargs) -> None:
    async def main():
        import redis.asyncio as redis

        client = redis.from_url(redis_url, socket_timeout=2)
        await client.flushdb()
        store = RedisBlockStore(client, **store_kwargs)
        try:
            await body(store, client)
        finally:
            await store.close()

    asyncio.run(main())


@pytest.mark.slow  # a real redis-server
def test_put_then_get_longest_run(redis_server):
    async def body(store, _client):
        assert await store.put(FMT, [(HASHES[i], payload(i)) for i in (0, 1, 2, 4)]) == 4
        assert await store.put(FMT, [(HASHES[0], payload(0))]) == 0  # already there
        assert await store.get_run(FMT, HASHES) == [payload(0), payload(1), payload(2)]
        assert await store.contains_run(FMT, HASHES) == 3
        assert await store.get_run(FMT, HASHES[3:]) == []
        for field, value in (("layout", "hm1:L2:H1:D4:B8"), ("dtype", "float16"), ("fingerprint", "fp-2")):
            other = dataclasses.replace(FMT, **{field: value})  # another key space: no refusals, no hits
            assert await store.get_run(other, HASHES) == []
        assert store.refused == {}
        stats = await store.stats()
        assert stats["blocks"] == 4 and stats["bytes"] >= 4 * FMT.block_bytes

    run(redis_server.url, body)


@pytest.mark.slow  # a real redis-server
def test_byte_cap_evicts_least_recently_used(redis_server):
    async def body(store, _client):
        size = len(encode_block(FMT, HASHES[0], payload(0)))
        await store.set_cap(3 * size)
        await store.put(FMT, [(HASHES[i], payload(i)) for i in range(3)])
        assert await store.get_run(FMT, HASHES[:1]) == [payload(0)]  # block 0 is now the most recent
        await store.put(FMT, [(HASHES[3], payload(3))])  # evicts block 1, the least recently used
        assert await store.contains_run(FMT, HASHES[:1]) == 1
        assert await store.contains_run(FMT, HASHES[1:2]) == 0
        assert await store.contains_run(FMT, HASHES[2:4]) == 2
        stats = await store.stats()
        assert stats == {"bytes": 3 * size, "cap_bytes": 3 * size, "blocks": 3, "evictions": 1}

    run(redis_server.url, body)


@pytest.mark.slow  # a real redis-server
def test_accounting_survives_keys_vanishing_behind_its_back(redis_server):
    async def body(store, client):
        size = len(encode_block(FMT, HASHES[0], payload(0)))
        await store.put(FMT, [(HASHES[0], payload(0))])
        await client.delete(FMT.key(HASHES[0]))  # by hand, or Redis maxmemory eviction
        assert await store.put(FMT, [(HASHES[0], payload(0))]) == 1
        stats = await store.stats()
        assert (stats["bytes"], stats["blocks"]) == (size, 1)
        await store.set_cap(size)
        await client.delete(FMT.key(HASHES[0]))
        await store.put(FMT, [(HASHES[1], payload(1))])  # evicts the vanished one; the ledger follows
        stats = await store.stats()
        assert (stats["bytes"], stats["blocks"]) == (size, 1)
        assert await store.get_run(FMT, HASHES[1:2]) == [payload(1)]

    run(redis_server.url, body)


@pytest.mark.slow  # a real redis-server
def test_corrupt_block_is_refused_and_deleted(redis_server):
    async def body(store, client):
        await store.put(FMT, [(HASHES[i], payload(i)) for i in range(3)])
        key = FMT.key(HASHES[1])
        blob = bytearray(await client.get(key))
        blob[-1] ^= 0xFF
        await client.set(key, bytes(blob))
        assert await store.get_run(FMT, HASHES) == [payload(0)]  # the run ends at the corrupt block
        assert store.refused == {"checksum": 1}
        assert await client.exists(key) == 0
        assert (await store.stats())["blocks"] == 2

    run(redis_server.url, body)


@pytest.mark.slow  # a real redis-server
@pytest.mark.parametrize(("field", "value"), [("fingerprint", "fp-2"), ("dtype", "float32"), ("model", "m2")])
def test_foreign_block_is_refused_loudly(redis_server, field, value, caplog):
    async def body(store, client):
        foreign = dataclasses.replace(FMT, **{field: value})
        # Written under our key by an engine with other weights, dtype or model name.
        await client.set(FMT.key(HASHES[0]), encode_block(foreign, HASHES[0], payload(0)))
        assert await store.get_run(FMT, HASHES) == []
        assert sum(store.refused.values()) == 1
        assert await client.exists(FMT.key(HASHES[0])) == 0  # not usable by anyone reading this key

    run(redis_server.url, body)
    assert "refused a shared KV block" in caplog.text


def test_decode_checks_hash_and_size():
    blob = encode_block(FMT, HASHES[0], payload(0))
    assert decode_block(FMT, HASHES[0], blob) == payload(0)
    with pytest.raises(BlockRefused) as err:
        decode_block(FMT, HASHES[1], blob)  # a block stored under the wrong hash
    assert err.value.reason == "checksum"
    with pytest.raises(BlockRefused):
        decode_block(FMT, HASHES[0], b"junk")
    with pytest.raises(ValueError, match="bytes"):
        encode_block(FMT, HASHES[0], os.urandom(3))


def test_store_down_raises_typed_error():
    from servers import free_port

    async def main():
        store = RedisBlockStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
        for call in (store.get_run(FMT, HASHES), store.put(FMT, [(HASHES[0], payload(0))]), store.stats()):
            with pytest.raises(BlockStoreUnavailable):
                await call
        await store.close()

    asyncio.run(main())
