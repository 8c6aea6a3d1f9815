"""The Responses store on a real redis-server and on a real 3-master Redis Cluster: what one tenant
writes, another never reads; the TTL; the per-tenant byte budget, least recently written first,
with the reason left behind; deletes give their bytes back."""

from __future__ import annotations

import asyncio
import time

from kvharbor.common.redis_client import connect
from kvharbor.gateway.response_store import RedisResponseStore


def record(rid: str, size: int = 0) -> dict:
    return {"response": {"id": rid, "status": "completed", "output": []}, "input": [], "context": [], "pad": "x" * size}


def with_store(url: str, ttl_s: float, budget: int, body):
    async def main():
        client = connect(url, timeout=2.0)
        try:
            return await body(RedisResponseStore(client, ttl_s, budget))
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_a_tenants_records_are_its_own_and_deletes_give_their_bytes_back(any_redis):
    async def body(store):
        await store.put("acme", "resp_1", record("resp_1"))
        mine = await store.get("acme", "resp_1")
        theirs = await store.get("other", "resp_1")
        deleted = await store.delete("acme", "resp_1")
        again = await store.delete("acme", "resp_1")
        # The budget holds ten 1,000-byte records once the first's bytes came back.
        writes = [await store.put("acme", f"resp_{i}", record(f"resp_{i}", 1000)) for i in range(10)]
        return mine, theirs, deleted, again, writes

    mine, theirs, deleted, again, writes = with_store(any_redis.url, 60, 11_000, body)
    assert mine.record["response"]["id"] == "resp_1"
    assert theirs.record is None and theirs.gone is None  # another tenant: simply not there
    assert deleted and not again
    assert all(w.evicted == 0 for w in writes)


def test_the_budget_evicts_the_least_recently_written_and_says_why(any_redis):
    async def body(store):
        first = [await store.put("acme", f"r{i}", record(f"r{i}", 1000)) for i in range(4)]  # 4 fit
        await store.put("acme", "r0", record("r0", 1000))  # rewritten: now the most recent
        other = await store.put("other", "o1", record("o1", 1000))
        written = await store.put("acme", "r5", record("r5", 1000))
        found = {rid: await store.get("acme", rid) for rid in ("r0", "r1", "r2", "r3", "r5")}
        huge = await store.put("acme", "big", record("big", 10_000))
        big = await store.get("acme", "big")
        return first, other, written, found, huge, big, await store.get("other", "o1")

    first, other, written, found, huge, big, kept_other = with_store(any_redis.url, 60, 4_500, body)
    assert [w.evicted for w in first] == [0, 0, 0, 0]
    assert other.evicted == 0 and kept_other.record is not None  # another tenant's writes evict nothing here
    # r0's rewrite replaced its own bytes, so r5's write evicted the least recently written: r1, not r0
    assert written.evicted == 1
    assert [rid for rid, f in found.items() if f.record is None] == ["r1"]
    assert found["r1"].gone == "budget"
    assert huge.too_large and big.record is None and big.gone == "too_large"


def test_a_record_is_gone_after_its_ttl_and_counted_at_the_next_write(any_redis):
    async def body(store):
        await store.put("acme", "old", record("old"))
        time.sleep(0.6)
        gone = await store.get("acme", "old")
        written = await store.put("acme", "new", record("new"))
        return gone, written

    gone, written = with_store(any_redis.url, 0.4, 10_000, body)
    assert gone.record is None and gone.gone is None
    assert written.expired == 1
