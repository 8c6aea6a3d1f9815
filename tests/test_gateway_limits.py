"""The gateway's per-tenant limits (gateway/limits.py) on one redis-server and on a Redis Cluster:
RPM, TPM and concurrency slots, exact across two gateways that share one Redis (two limiters
with their own clients, and two real gateway processes on the cluster), and the open / closed
policies when Redis cannot be reached. The local-bucket fallback and the key layout are checked
without any process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid

import httpx
import pytest
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from kvharbor.common.redis_client import connect, connect_sync
from kvharbor.common.redis_keys import rate_limit_key
from kvharbor.gateway.limits import LimiterUnavailable, RateLimiter
from kvharbor.gateway.tenants import Limits, Tenant
from kvharbor.launch.embedded_redis import free_port

MODEL = "SmolLM2-135M-Instruct"  # the bundled model's name: the gateway reads its tokenizer


def tenant(name="t", **limits) -> Tenant:
    return Tenant(name, frozenset(), limits=Limits(**limits))


async def _rpm_tpm_and_concurrency(limiter: RateLimiter) -> None:
    rpm = tenant("r", rpm=2)
    assert (await limiter.admit(rpm, 10, "1")).ok and (await limiter.admit(rpm, 10, "2")).ok
    third = await limiter.admit(rpm, 10, "3")
    assert not third.ok and third.reason == "rpm" and 0 < third.retry_after_s <= 30
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    tpm = tenant("k", tpm=100)
    assert (await limiter.admit(tpm, 60, "1")).ok
    await limiter.debit_tokens(tpm, 30)  # streamed output
    assert (await limiter.admit(tpm, 20, "2")).reason == "tpm"
    big = tenant("big", tpm=100)
    assert (await limiter.admit(big, 5000, "1")).ok  # a prompt over the minute's budget still fits an idle bucket
    conc = tenant("c", max_concurrent=1)
    assert (await limiter.admit(conc, 1, "a")).ok
    assert (await limiter.admit(conc, 1, "b")).reason == "concurrency"
    await limiter.release(conc, "a")
    assert (await limiter.admit(conc, 1, "b")).ok
    listed = tenant("w", max_concurrent=3)  # issue 47: a prompt list takes a slot per prompt
    assert (await limiter.admit(listed, 1, "list", weight=2)).ok
    assert (await limiter.admit(listed, 1, "pair", weight=2)).reason == "concurrency"
    assert (await limiter.admit(listed, 1, "one")).ok
    await limiter.renew_slot(listed, "list", weight=2)
    await limiter.release(listed, "list", weight=2)
    assert (await limiter.admit(listed, 1, "pair", weight=2)).ok
    all_three = tenant("all", rpm=5, tpm=1000, max_concurrent=2)  # one script over all three keys
    assert (await limiter.admit(all_three, 10, "x")).ok
    assert (await limiter.admit(tenant("free"), 10**6, "x")).ok


def test_limits_in_this_process_without_redis():
    asyncio.run(_rpm_tpm_and_concurrency(RateLimiter(None)))


def test_a_tenants_keys_share_one_cluster_slot():
    limiter = RateLimiter(None)
    for name in ("acme", "t1", "a.b-c_d", "x" * 63):
        keys = limiter._keys(tenant(name))
        assert keys == [rate_limit_key(name, kind) for kind in ("rpm", "tpm", "conc")]
        assert keys[0] == f"kvharbor:rl:{{{name}}}:rpm"
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
    # Tenants spread over slots (they are not all on one node).
    assert len({key_slot(rate_limit_key(f"tenant{i}", "rpm").encode()) for i in range(20)}) > 1


class _CrossSlotClient:
    """A cluster client that refuses the call as one over keys of several slots."""

    def register_script(self, source):
        async def script(keys, args):
            raise RedisClusterException("EVALSHA - all keys must map to the same key slot")

        return script


def test_keys_of_several_slots_are_a_bug_not_an_outage():
    limiter = RateLimiter(_CrossSlotClient(), policy="open")
    with pytest.raises(RedisClusterException, match="same key slot"):  # not a silent local fallback
        asyncio.run(limiter.admit(tenant("x", rpm=1), 1, "1"))
    assert limiter.redis_failures == 0


def test_limits_on_redis(any_redis):
    async def main():
        client = connect(any_redis.url)
        try:
            await _rpm_tpm_and_concurrency(RateLimiter(client, policy="closed"))  # closed: no silent fallback
        finally:
            await client.aclose()
        with connect_sync(any_redis.url) as check:  # the buckets are in Redis, where the hash tag puts them
            assert check.exists(rate_limit_key("r", "rpm"), rate_limit_key("k", "tpm")) == 2
            assert check.zcard(rate_limit_key("c", "conc")) == 1  # "b"; "a" was released

    asyncio.run(main())


async def _renewed_and_abandoned(limiter: RateLimiter) -> None:
    one = tenant("renew", max_concurrent=1)
    assert (await limiter.admit(one, 1, "stream-a")).ok
    for _ in range(6):  # 0.6 s, twice the lease
        await asyncio.sleep(0.1)
        await limiter.renew_slot(one, "stream-a")
        assert (await limiter.admit(one, 1, "other")).reason == "concurrency"
    await asyncio.sleep(0.4)  # no renewal: the lease lapses
    assert (await limiter.admit(one, 1, "other")).ok
    await limiter.renew_slot(one, "never-admitted")  # renewing a slot it does not hold takes none
    assert (await limiter.admit(one, 1, "third")).reason == "concurrency"


def test_a_renewed_slot_outlives_its_lease_in_this_process():
    asyncio.run(_renewed_and_abandoned(RateLimiter(None, slot_ttl=0.3)))


def test_a_renewed_slot_outlives_its_lease_and_an_abandoned_one_lapses(any_redis):
    """A stream renews its slot while it lives (gateway/relay.py): past the lease it still holds
    it; once renewals stop (a gateway died), the slot lapses and the tenant gets it back."""

    async def main():
        client = connect(any_redis.url, timeout=2)
        try:
            await _renewed_and_abandoned(RateLimiter(client, "closed", slot_ttl=0.3))
        finally:
            await client.aclose()

    asyncio.run(main())


def test_two_gateways_keep_exact_rpm_and_concurrency(any_redis):
    """Two limiters with their own clients (two gateways) on one Redis: admits race from both."""

    async def main():
        clients = [connect(any_redis.url), connect(any_redis.url)]
        try:
            g1, g2 = (RateLimiter(c, policy="closed") for c in clients)
            gateways = [g1, g2]

            async def burst(t: Tenant, n: int, tag: str) -> list:
                return list(await asyncio.gather(*(gateways[i % 2].admit(t, 5, f"{tag}{i}") for i in range(n))))

            rpm = tenant("rpm10", rpm=10)
            decisions = await burst(rpm, 30, "r")
            assert sum(d.ok for d in decisions) == 10
            assert {d.reason for d in decisions if not d.ok} == {"rpm"}
            # Refill is 10/min, one per 6 s: the next one, from either gateway, waits.
            assert not (await g2.admit(rpm, 5, "late")).ok

            conc = tenant("slots3", max_concurrent=3)
            decisions = await burst(conc, 12, "c")
            held = [f"c{i}" for i, d in enumerate(decisions) if d.ok]
            assert len(held) == 3 and {d.reason for d in decisions if not d.ok} == {"concurrency"}
            # A slot taken through one gateway and given back through the other frees it for both.
            holder = int(held[0][1:]) % 2
            await gateways[1 - holder].release(conc, held[0])
            again = await burst(conc, 8, "d")
            assert sum(d.ok for d in again) == 1
            assert not (await g1.admit(conc, 5, "full")).ok
        finally:
            for c in clients:
                await c.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_redis_down_follows_the_policy(scheme):
    """Nothing listens on the port: `open` enforces the limits in this gateway alone, `closed`
    refuses with a message that says to retry; release and debit never raise."""

    async def main():
        dead = connect(f"{scheme}://127.0.0.1:{free_port()}/0", timeout=0.3)
        try:
            open_limiter = RateLimiter(dead, policy="open")
            t = tenant("o", rpm=1, tpm=100, max_concurrent=1)
            assert (await open_limiter.admit(t, 1, "1")).ok
            assert not (await open_limiter.admit(t, 1, "2")).ok  # still enforced, locally
            await open_limiter.debit_tokens(t, 10)
            await open_limiter.release(t, "1")
            assert open_limiter.redis_failures == 2
            closed = RateLimiter(dead, policy="closed")
            with pytest.raises(LimiterUnavailable, match="retry"):
                await closed.admit(t, 1, "1")
            await closed.release(t, "1")
        finally:
            await dead.aclose()

    asyncio.run(main())


# -- two real gateway processes on the cluster -------------------------------------------------------


@pytest.fixture
def two_gateways_on_the_cluster(tmp_path, redis_cluster):
    """Two `kvharbor gateway` processes on one Redis Cluster, fail-closed (a Redis problem is a
    503, never a local bucket), with an engine that never answers: a request the limits let
    through waits in the admission queue, holding its slot, and ends as a 503 queue_timeout;
    one they stop is a 429. No engine is needed to tell the two apart."""
    from servers import GatewayProcess, write_tenants

    redis_cluster.flush()
    tag = uuid.uuid4().hex[:8]
    keys = write_tenants(tmp_path / "tenants.yaml", [
        {"name": f"rpm-{tag}", "key": "sk-rpm", "limits": {"rpm": 4}},
        {"name": f"slots-{tag}", "key": "sk-slots", "limits": {"max_concurrent": 2}},
    ])  # fmt: skip
    args = ("--engines", f"http://127.0.0.1:{free_port()}", "--tenants-file", str(tmp_path / "tenants.yaml"),
            "--redis-url", redis_cluster.url, "--limits-on-redis-failure", "closed",
            "--queue-timeout", "1.0")  # fmt: skip
    gateways = [GatewayProcess(tmp_path, *args), GatewayProcess(tmp_path, *args)]
    try:
        for g in gateways:
            g.launch()  # both read the tokenizer at once
        for g in gateways:
            g.wait_ready(60)
        yield gateways, keys, tag
    finally:
        for g in gateways:
            g.stop()


def _codes(gateways, key: str, n: int) -> list[str]:
    """n requests at once, alternating between the gateways; each one's error code."""

    def one(i: int) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1}
        resp = httpx.post(gateways[i % 2].url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
        assert resp.status_code in (429, 503), resp.text
        return resp.json()["error"]["code"]

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.slow  # two gateway processes and the Redis Cluster
def test_two_gateway_processes_on_a_redis_cluster_keep_exact_limits(two_gateways_on_the_cluster, redis_cluster):
    gateways, keys, tag = two_gateways_on_the_cluster
    codes = _codes(gateways, keys[f"rpm-{tag}"], 10)
    assert sorted(codes) == ["queue_timeout"] * 4 + ["rate_limit_rpm"] * 6, codes
    codes = _codes(gateways, keys[f"slots-{tag}"], 8)  # 2 hold a slot for the queue timeout
    assert sorted(codes) == ["queue_timeout"] * 2 + ["rate_limit_concurrency"] * 6, codes
    assert _codes(gateways, keys[f"slots-{tag}"], 1) == ["queue_timeout"]  # the slots came back
    with connect_sync(redis_cluster.url) as check:  # the limits were kept in the cluster
        assert check.exists(rate_limit_key(f"rpm-{tag}", "rpm")) == 1
        assert check.zcard(rate_limit_key(f"slots-{tag}", "conc")) == 0
