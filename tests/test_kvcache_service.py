"""`kvharbor kvcache` as a real process against a real redis-server: lookups over HTTP, malformed
events, leases, bad input, a kill -9 mid-stream, and a Redis outage."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import pytest
import redis
from kv_event_writer import FakeEngine, chains, random_events
from servers import KVCacheServiceProcess, RedisProcess, wait_for

from kvharbor.common.block_hash import block_hashes, to_hex
from kvharbor.common.redis_client import connect_sync
from kvharbor.kvcache_service.memory_index import MemoryIndex

pytestmark = pytest.mark.slow  # real redis-servers and `kvharbor kvcache`

MODEL = "svc-model"


def lookup(url: str, hashes, **extra) -> httpx.Response:
    return httpx.post(
        url + "/lookup", json={"model": MODEL, "block_hashes": [to_hex(h) for h in hashes], **extra}, timeout=10
    )


def drained(url: str, applied: int) -> bool:
    stats = httpx.get(url + "/stats", timeout=5).json()
    return stats["intake"]["applied"] + stats["intake"]["duplicates"] >= applied


def all_acknowledged(client, engines) -> bool:
    """Every entry of every engine's stream was delivered to the service's group and acknowledged."""
    for engine in engines:
        last = client.xinfo_stream(engine.stream)["last-generated-id"]
        groups = client.xinfo_groups(engine.stream)
        if not (groups and groups[0]["last-delivered-id"] == last and groups[0]["pending"] == 0):
            return False
    return True


@pytest.fixture
def redis_fresh(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    return redis_server, client


def test_lookup_instances_stats_and_leases(redis_fresh, tmp_path):
    server, client = redis_fresh
    a, b = FakeEngine(client, MODEL, "a"), FakeEngine(client, MODEL, "b")
    tokens = list(range(100, 100 + 64))  # 4 blocks of 16
    hashes = block_hashes(tokens, 16, MODEL, "tenant-1")
    a.heartbeat()
    b.heartbeat()
    a.publish(a.stored(hashes))
    b.publish(b.stored(hashes[:2]))
    client.xadd(a.stream, {"garbage": "1"})
    with KVCacheServiceProcess(tmp_path, server.url, "--lease-sweep-interval", "0.3") as svc:
        wait_for(lambda: drained(svc.url, 2), what="intake")
        assert lookup(svc.url, hashes).json() == {"model": MODEL, "blocks": 4, "matches": {"a": 4, "b": 2}}
        by_tokens = httpx.post(
            svc.url + "/lookup", json={"model": MODEL, "token_ids": tokens + [7] * 5, "cache_salt": "tenant-1"}
        ).json()
        assert by_tokens["matches"] == {"a": 4, "b": 2} and by_tokens["blocks"] == 4
        other_tenant = httpx.post(svc.url + "/lookup", json={"model": MODEL, "token_ids": tokens, "cache_salt": "t2"})
        assert other_tenant.json()["matches"] == {}  # instances that hold none of it are absent
        adapter = {"model": MODEL, "token_ids": tokens, "cache_salt": "tenant-1", "adapter": "sql@0123"}
        assert httpx.post(svc.url + "/lookup", json=adapter).json()["matches"] == {}
        stats = httpx.get(svc.url + "/stats").json()
        assert stats["intake"]["malformed"] == {"invalid": 1} and stats["intake"]["leader"]
        assert stats["index"] == {"instances": 2, "alive": 2, "blocks": 6}
        assert httpx.get(svc.url + "/ready").status_code == 200
        metrics = httpx.get(svc.admin_url + "/metrics").text
        assert 'kvharbor_kvcache_events_malformed_total{reason="invalid"} 1.0' in metrics
        assert "kvharbor_kvcache_lookups_total" in metrics
        # b's last heartbeat is a short one: its lease lapses, so it drops out of lookups, then out of
        # the index. (Shortened only now: a short lease from the start could lapse before the slow
        # service start-up on a busy machine, and the lookups above would miss b.)
        b.heartbeat(ttl=0.5)
        wait_for(lambda: "b" not in lookup(svc.url, hashes).json()["matches"], what="lease expiry")
        wait_for(
            lambda: [i["instance"] for i in httpx.get(svc.url + "/instances").json()["instances"]] == ["a"],
            what="sweep",
        )
        a.publish(a.stored(block_hashes(tokens, 16, MODEL, "tenant-1", "sql@0123")))  # a LoRA adapter's chain
        wait_for(lambda: httpx.post(svc.url + "/lookup", json=adapter).json()["matches"] == {"a": 4}, what="intake")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, None),
        ({"model": MODEL, "block_hashes": ["zz"]}, 400, None),
        ({"model": MODEL, "block_hashes": [], "token_ids": []}, 400, None),
        ({"model": "", "block_hashes": []}, 400, "model"),
        ({"model": MODEL, "token_ids": [1, -2]}, 400, None),
        ({"model": MODEL, "token_ids": [2**31]}, 400, None),
        ({"model": MODEL, "block_hashes": ["ab" * 16] * 16385}, 400, "block_hashes"),
        ({"model": MODEL, "block_hashes": [], "cache_salt": "x"}, 400, None),
        ({"model": "never-seen", "token_ids": [1] * 40}, 404, "model"),
        ({"model": MODEL, "block_hashes": [], "tier": "disk"}, 400, "tier"),
        ({"model": MODEL, "block_hashes": [], "surprise": 1}, 400, "surprise"),
    ],
)
def test_bad_lookups_get_clear_4xx(kvcache_service, body, status, param):
    response = httpx.post(kvcache_service.url + "/lookup", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "raw", [b'{"model": "svc-model", "token_ids": [1, 2], "cache_salt": "\\ud800"}', b'{"model": "\xff"}']
)
def test_text_that_is_not_unicode_gets_400(kvcache_service, raw):
    resp = httpx.post(kvcache_service.url + "/lookup", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_unicode", resp.text


def test_malformed_json_and_unknown_path(kvcache_service):
    response = httpx.post(kvcache_service.url + "/lookup", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert httpx.get(kvcache_service.url + "/nope").status_code == 404


@pytest.fixture(scope="module")
def kvcache_service(tmp_path_factory):
    # Its own Redis: a service on the shared one would take over streams other tests consume.
    workdir = tmp_path_factory.mktemp("kvcache")
    with RedisProcess(workdir / "redis") as own, KVCacheServiceProcess(workdir, own.url) as svc:
        yield svc


def test_two_replicas_on_a_cluster_one_killed_mid_stream_every_event_applied_once(redis_cluster, tmp_path):
    """Two `kvharbor kvcache` replicas share six engines' streams on a real Redis Cluster; one is
    SIGKILLed mid-stream (no goodbye: its ownership and membership lapse, its delivered entries
    stay pending). The other takes its streams over: nothing is lost, nothing applied twice
    (a replayed store after a removal would show in the lookups)."""
    redis_cluster.flush()
    client = connect_sync(redis_cluster.url, timeout=2)
    rng = random.Random(3)
    cs = chains(MODEL, 5, 6)
    engines = [FakeEngine(client, MODEL, f"e{i}") for i in range(6)]
    for engine in engines:
        engine.heartbeat()
    reference_events = []
    args = ("--intake-batch", "20", "--owner-ttl", "2", "--rebalance-interval", "0.2")
    replicas = [
        KVCacheServiceProcess(tmp_path, redis_cluster.url, *args, "--consumer-name", f"replica-{i}") for i in range(2)
    ]
    for replica in replicas:
        replica.launch()
    try:
        survivor = replicas[1]
        for replica in replicas:
            replica.wait_ready()
        wait_for(lambda: all(httpx.get(r.url + "/stats").json()["intake"]["streams"] for r in replicas), what="split")
        for i in range(60):
            engine = rng.choice(engines)
            reference_events += engine.publish(*random_events(rng, MODEL, cs, 5))
            if i == 40:
                replicas[0].signal(signal.SIGKILL)
                replicas[0].wait(10)
        wait_for(lambda: all_acknowledged(client, engines), timeout=40, what="catch-up by the survivor")
        stats = httpx.get(survivor.url + "/stats").json()["intake"]
        assert stats["malformed"] == {} and stats["members"] == 1
        assert sorted(stats["streams"]) == sorted(e.stream for e in engines)

        async def expected():
            ref = MemoryIndex()
            await ref.apply(reference_events)
            for engine in engines:
                await ref.renew(MODEL, engine.instance, engine.lease, 60)
            return {to_hex(h): await ref.lookup(MODEL, [h]) for c in cs for h in c}

        want = asyncio.run(expected())
        got = {to_hex(h): lookup(survivor.url, [h]).json()["matches"] for c in cs for h in c}
        assert got == want
    finally:
        for replica in replicas:
            replica.stop()


def test_redis_outage_unready_fast_errors_then_recovery(tmp_path):
    redis_proc = RedisProcess(tmp_path / "r1").start()
    port = redis_proc.port
    try:
        client = redis.Redis.from_url(redis_proc.url)
        engine = FakeEngine(client, MODEL, "a")
        hashes = chains(MODEL, 1, 3)[0]
        engine.heartbeat()
        engine.publish(engine.stored(hashes))
        with KVCacheServiceProcess(tmp_path, redis_proc.url, "--redis-timeout", "0.5") as svc:
            wait_for(lambda: lookup(svc.url, hashes).json()["matches"] == {"a": 3}, what="intake")
            redis_proc.stop()
            started = time.monotonic()
            ready = httpx.get(svc.url + "/ready", timeout=10)
            failed = lookup(svc.url, hashes)
            assert time.monotonic() - started < 8  # answers come back within the Redis timeout
            assert ready.status_code == 503 and ready.json()["redis"] == "down"
            assert failed.status_code == 503
            assert failed.json()["error"]["code"] == "index_unavailable" and failed.headers["Retry-After"]
            assert httpx.get(svc.url + "/health").status_code == 200
            # Redis comes back empty; the engine re-publishes what it holds (as kvharbor serve does).
            redis_proc = RedisProcess(tmp_path / "r2", port=port).start()
            client = redis.Redis.from_url(redis_proc.url)
            engine = FakeEngine(client, MODEL, "a", lease="second-life")
            engine.heartbeat()
            engine.publish(engine.stored(hashes[:2]))
            wait_for(lambda: httpx.get(svc.url + "/ready").status_code == 200, what="ready again")
            wait_for(lambda: lookup(svc.url, hashes).json().get("matches") == {"a": 2}, what="index rebuilt")
    finally:
        redis_proc.stop()
