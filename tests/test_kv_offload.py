"""The engine's shared-store client on a real redis-server: write-back on eviction and
write-through push, pulls that skip what is cached locally and ask the engine thread what it has."""

from __future__ import annotations

import asyncio

import pytest
import redis

from kvharbor.common.block_hash import block_hashes
from kvharbor.engine import SamplingParams
from kvharbor.engine.kv.kv_offload import KVStoreClient
from kvharbor.kvcache_service.block_store import RedisBlockStore

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 131 + i * 17) % 500 + 3 for i in range(n)]


def client_for(llm, url: str) -> KVStoreClient:
    """A client over the engine's save queue: the LLM was built with its push policy (kv_save=)."""
    return KVStoreClient(RedisBlockStore.from_url(url), llm.engine.core)


async def flush(client: KVStoreClient) -> None:
    task = asyncio.create_task(client.run())
    for _ in range(200):
        await asyncio.sleep(0.01)
        if not client.pending:  # written (or dropped), not just taken off the queue
            break
    await asyncio.sleep(0.05)
    await client.stop()
    task.cancel()


@pytest.mark.slow  # a real redis-server
def test_evicted_blocks_are_written_back_and_pulled_again(tiny_llama, make_llm, redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    # 12 blocks of 16 tokens: the second prompt's 7 blocks evict the tail of the first's.
    llm = make_llm(tiny_llama.loaded, num_kv_blocks=12, max_model_len=192, kv_save="evict")
    first = prompt(1)
    want = make_llm(tiny_llama.loaded).generate([first], GREEDY)[0].outputs[0].token_ids
    hashes = block_hashes(first[:-1], 16, llm.engine.core.model_name)

    async def main():
        client = client_for(llm, redis_server.url)
        llm.generate([first], GREEDY)
        assert not client.saves.queued()  # nothing evicted yet
        llm.generate([prompt(2)], GREEDY)
        assert client.saves.queued()  # the first prompt's tail blocks, copied before their slots were reused
        await flush(client)
        pushed = int(client.counters.values["kv_store_pushed_blocks"][""])
        assert pushed >= 1

        client = client_for(llm, redis_server.url)  # a fresh client: it pulls
        local = sum(h in llm.engine.core.pool.cached for h in hashes)
        assert local == len(hashes) - pushed
        ext = await client.pull(first, None)  # the head is cached here; the tail comes back from the store
        assert ext is not None and ext.hashes == hashes[local:] and ext.prefix == hashes[:local]
        assert llm.engine.core.import_prefix(ext.hashes, ext.payloads, ext.prefix) == pushed
        out = llm.generate([first], GREEDY)[0]
        assert out.num_cached_tokens == 16 * len(hashes)
        assert out.outputs[0].token_ids == want
        assert await client.pull(first, None) is None  # all cached again: nothing to pull
        await client.stop()

    asyncio.run(main())


@pytest.mark.slow  # a real redis-server
def test_write_through_pushes_each_filled_block_once(tiny_llama, make_llm, redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    llm = make_llm(tiny_llama.loaded, kv_save="all")

    async def main():
        writer = client_for(llm, redis_server.url)
        llm.generate([prompt(3, 70)], GREEDY)  # 73 tokens computed: 4 full blocks
        llm.generate([prompt(3, 70)], GREEDY)  # the same blocks again: not copied twice
        assert len(writer.saves.queued()) == 4
        await flush(writer)
        stats = await RedisBlockStore.from_url(redis_server.url).stats()
        assert stats["blocks"] == 4

    asyncio.run(main())


@pytest.mark.slow  # a real redis-server
def test_hot_pushes_a_prefix_when_it_is_reused(tiny_llama, make_llm, redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    llm = make_llm(tiny_llama.loaded, kv_save="hot")
    system = prompt(4, 64)  # 4 full blocks, shared by two requests

    async def main():
        client = client_for(llm, redis_server.url)
        llm.generate([[*system, 5, 6, 7]], GREEDY)
        assert not client.saves.queued()  # seen once: not hot yet
        llm.generate([[*system, 8, 9]], GREEDY)
        hashes = block_hashes(system, 16, llm.engine.core.model_name)
        assert [h for h, _ in client.saves.queued()] == hashes  # reused: the whole prefix, in chain order
        await flush(client)
        reader = client_for(make_llm(tiny_llama.loaded), redis_server.url)  # it pushes nothing
        ext = await reader.pull([*system, 1], None)
        assert ext is not None and ext.hashes == hashes
        await reader.stop()

    asyncio.run(main())


@pytest.mark.slow  # a real redis-server
def test_pull_asks_the_engine_thread_what_is_cached(tiny_llama, make_llm, redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    llm = make_llm(tiny_llama.loaded)
    asked = []

    async def ask(fn):
        asked.append(fn)
        return fn(llm.engine.core)

    async def main():
        store = RedisBlockStore.from_url(redis_server.url)
        client = KVStoreClient(store, llm.engine.core, ask=ask)
        assert await client.pull(prompt(5), None) is None  # nothing in the store
        assert len(asked) == 1  # the pool was read through `ask`, not from this coroutine
        await client.stop()

    asyncio.run(main())
