"""One conformance suite for both `Index` backends (in memory, and Redis on a real redis-server)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvharbor.common.block_hash import block_hashes, hash_block, namespace_hash
from kvharbor.common.kv_events import AllCleared, BlockRemoved, BlockStored, EventEnvelope
from kvharbor.kvcache_service.index import IndexUnavailable, StreamEvent
from kvharbor.kvcache_service.memory_index import MemoryIndex
from kvharbor.kvcache_service.redis_index import RedisIndex

MODEL = "m"
BS = 4


def chain(n: int, salt: str | None = None, start: int = 0) -> list[bytes]:
    tokens = list(range(start, start + n * BS))
    return block_hashes(tokens, BS, MODEL, cache_salt=salt)


def env(instance: str, event, lease: str | None = None, model: str = MODEL) -> EventEnvelope:
    return EventEnvelope(event, instance, model, lease or f"lease-{instance}", seq=0)


def stored(instance: str, hashes, parent=None, tier="device", lease=None) -> EventEnvelope:
    return env(instance, BlockStored(tuple(hashes), parent, BS, tier=tier), lease)


class Backend:
    """Opens one backend inside the running event loop, and moves its clock."""

    def __init__(self, kind: str, redis_url: str | None) -> None:
        self.kind, self.redis_url, self.now = kind, redis_url, 1000.0

    async def open(self):
        if self.kind == "memory":
            return MemoryIndex(clock=lambda: self.now)
        return RedisIndex.from_url(self.redis_url, timeout=2)

    async def advance(self, seconds: float) -> None:
        if self.kind == "memory":
            self.now += seconds
        else:
            await asyncio.sleep(seconds)  # Redis expires leases on its own clock


@pytest.fixture(params=["memory", *(pytest.param(kind, marks=pytest.mark.slow) for kind in ("redis", "cluster"))])
def backend(request) -> Backend:
    """In memory, on a real redis-server, and on a real 3-master Redis Cluster (flushed)."""
    if request.param == "memory":
        return Backend("memory", None)
    server = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    server.flush()
    return Backend(request.param, server.url)


def run(backend: Backend, body) -> None:
    async def main():
        index = await backend.open()
        try:
            await body(index)
        finally:
            await index.close()

    asyncio.run(main())


async def alive(index, *instances: str, ttl: float = 60.0) -> None:
    for inst in instances:
        await index.renew(MODEL, inst, f"lease-{inst}", ttl)


def test_chain_matching_stops_at_first_break(backend):
    async def body(index):
        h = chain(6)
        await alive(index, "a")
        await index.apply([stored("a", h[:3]), stored("a", h[4:])])  # block 3 missing
        assert await index.lookup(MODEL, h) == {"a": 3}
        assert await index.lookup(MODEL, h[:2]) == {"a": 2}
        assert await index.lookup(MODEL, h[3:]) == {}  # the query's block 0 is missing: absent means 0
        assert await index.lookup(MODEL, []) == {}
        assert await index.lookup("other-model", h) == {}

    run(backend, body)


def test_each_holder_counts_up_to_its_own_first_gap(backend):
    """Holders drop out at different blocks and some hold later blocks again: the read's runs of
    equal holders must still give each one its own consecutive count."""

    async def body(index):
        h = chain(8)
        await alive(index, "a", "b", "c")
        await index.apply([
            stored("a", h),  # all 8
            stored("b", h[:2]), stored("b", h[3:]),  # misses block 2, holds 3-7 again
            stored("c", h[:5]),  # stops after 5
        ])  # fmt: skip
        assert await index.lookup(MODEL, h) == {"a": 8, "b": 2, "c": 5}
        assert await index.lookup(MODEL, h[:4]) == {"a": 4, "b": 2, "c": 4}
        await index.apply([env("a", BlockRemoved((h[6],)))])  # nobody holds block 6 now
        assert await index.lookup(MODEL, h) == {"a": 6, "b": 2, "c": 5}

    run(backend, body)


def test_a_hash_of_another_length_is_refused(backend):
    async def body(index):
        h = chain(3)
        await alive(index, "a")
        await index.apply([stored("a", h)])
        for bad in ([h[0], h[1][:8], h[2]], [h[0] + b"x"], [b""]):
            with pytest.raises(ValueError, match="16 bytes each"):
                await index.lookup(MODEL, bad)
        assert await index.lookup(MODEL, h) == {"a": 3}

    run(backend, body)


def test_several_instances_and_filter(backend):
    async def body(index):
        h = chain(5)
        await alive(index, "a", "b", "c")
        await index.apply([stored("a", h), stored("b", h[:2]), stored("c", chain(2, start=1000))])
        assert await index.lookup(MODEL, h) == {"a": 5, "b": 2}  # c holds none of it
        assert await index.lookup(MODEL, h, instances=["b", "c"]) == {"b": 2}
        assert await index.lookup(MODEL, h, instances=[]) == {}
        assert await index.lookup(MODEL, h, instances=["nobody"]) == {}
        infos = {i.instance: i for i in await index.instances()}
        assert {k: v.blocks for k, v in infos.items()} == {"a": 5, "b": 2, "c": 2}
        assert all(i.alive and i.model == MODEL for i in infos.values())

    run(backend, body)


def test_removal_and_cleared(backend):
    async def body(index):
        h = chain(4)
        await alive(index, "a", "b")
        await index.apply([stored("a", h), stored("b", h)])
        await index.apply([env("a", BlockRemoved((h[1],)))])
        assert await index.lookup(MODEL, h) == {"a": 1, "b": 4}
        await index.apply([env("b", AllCleared())])
        assert await index.lookup(MODEL, h) == {"a": 1}
        await index.apply([stored("b", h[:2])])  # a cleared instance fills up again
        assert await index.lookup(MODEL, h) == {"a": 1, "b": 2}

    run(backend, body)


def test_lease_expiry_drops_instance_and_sweeps_entries(backend):
    async def body(index):
        h = chain(3)
        await alive(index, "a")
        await index.renew(MODEL, "b", "lease-b", 0.3)
        await index.apply([stored("a", h), stored("b", h)])
        assert await index.lookup(MODEL, h) == {"a": 3, "b": 3}
        await backend.advance(0.6)
        assert await index.lookup(MODEL, h) == {"a": 3}  # gone from lookups before any sweep
        assert [(i.instance, i.alive) for i in await index.instances()] == [("a", True), ("b", False)]
        assert await index.expire() == [(MODEL, "b")]
        assert [i.instance for i in await index.instances()] == ["a"]
        # The sweep removed b's entries: renewing the same lease brings b back holding nothing.
        await index.renew(MODEL, "b", "lease-b", 60)
        await index.apply([env("b", BlockRemoved((h[2],)))])
        assert await index.lookup(MODEL, h) == {"a": 3}
        assert await index.expire() == []

    run(backend, body)


def test_new_lease_starts_a_new_life(backend):
    async def body(index):
        h = chain(3)
        await index.apply([stored("a", h, lease="old")])
        await index.renew(MODEL, "a", "new", 60)
        assert await index.lookup(MODEL, h) == {}  # the events' lease is not the live one
        await index.apply([stored("a", h[:1], lease="new")])
        assert await index.lookup(MODEL, h) == {"a": 1}  # what "old" held is gone

    run(backend, body)


def test_tenant_salts_never_match_each_other(backend):
    async def body(index):
        tokens = list(range(40))
        acme = block_hashes(tokens, BS, MODEL, cache_salt="acme")
        globex = block_hashes(tokens, BS, MODEL, cache_salt="globex")
        await alive(index, "a")
        await index.apply([stored("a", acme)])
        assert await index.lookup(MODEL, acme) == {"a": 10}
        assert await index.lookup(MODEL, globex) == {}
        assert await index.lookup(MODEL, block_hashes(tokens, BS, MODEL)) == {}

    run(backend, body)


def test_tiers_are_separate(backend):
    async def body(index):
        h = chain(3)
        await alive(index, "a")
        await index.apply([stored("a", h, tier="shared")])
        assert await index.lookup(MODEL, h) == {}
        assert await index.lookup(MODEL, h, tier="shared") == {"a": 3}
        assert await index.block_size(MODEL) == BS
        assert await index.block_size("unknown") is None

    run(backend, body)


def test_stream_positions_apply_exactly_once(backend):
    async def body(index):
        h = chain(2)
        await alive(index, "a")
        batch = [
            StreamEvent(stored("a", h), "s", "5-0"),
            StreamEvent(env("a", BlockRemoved((h[0],))), "s", "5-1"),
        ]
        assert await index.apply(batch) == 2
        assert await index.lookup(MODEL, h) == {}
        # Delivered again (a consumer died before acknowledging): nothing is applied twice, so the
        # removal is not undone by a replayed store.
        assert await index.apply(batch) == 0
        assert await index.apply([*batch[:1], StreamEvent(stored("a", h[:1]), "s", "6-0")]) == 1
        assert await index.lookup(MODEL, h) == {"a": 2}
        # Cursors are per stream.
        assert await index.apply([StreamEvent(stored("a", chain(1, start=99)), "t", "1-0")]) == 1

    run(backend, body)


def test_hash_chain_is_the_engines(backend):
    """The index keys on the shared hash function: a chain built block by block matches."""

    async def body(index):
        tokens = list(range(12))
        parent = namespace_hash(MODEL)
        manual = []
        for i in range(0, 12, BS):
            parent = hash_block(parent, tokens[i : i + BS])
            manual.append(parent)
        await alive(index, "a")
        await index.apply([stored("a", manual)])
        assert await index.lookup(MODEL, block_hashes(tokens, BS, MODEL)) == {"a": 3}

    run(backend, body)


def test_redis_down_raises_typed_error_fast():
    from servers import free_port

    async def body():
        index = RedisIndex.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
        started = time.monotonic()
        for call in (index.lookup(MODEL, chain(2)), index.apply([stored("a", chain(1))]), index.instances()):
            with pytest.raises(IndexUnavailable):
                await call
        assert time.monotonic() - started < 10  # bounded: no call hangs
        assert await index.ping() is False
        await index.close()

    asyncio.run(body())


def test_events_of_a_previous_life_are_ignored(backend):
    async def body(index):
        h = chain(3)
        await index.renew(MODEL, "a", "second", 60)
        await index.apply([stored("a", h[:2], lease="second")])
        # A late `cleared` and store from the previous process, still in the stream.
        assert await index.apply([env("a", AllCleared(), lease="first"), stored("a", h, lease="first")]) == 0
        assert await index.lookup(MODEL, h) == {"a": 2}

    run(backend, body)


def test_forget_drops_instances_and_ignores_their_late_events(backend):
    async def body(index):
        h = chain(3)
        await alive(index, "svc-a", "svc-b", "other")
        await index.apply([stored("svc-a", h), stored("svc-b", h[:2]), stored("other", h)])
        assert await index.forget(MODEL, ["svc-a", "svc-b", "never-seen"]) == 2
        assert await index.lookup(MODEL, h) == {"other": 3}
        assert [i.instance for i in await index.instances()] == ["other"]
        # An event a forgotten engine wrote before it stopped, consumed late, does not bring it back.
        await index.apply([stored("svc-a", h)])
        assert await index.lookup(MODEL, h) == {"other": 3}
        assert await index.forget(MODEL, []) == 0

    run(backend, body)
