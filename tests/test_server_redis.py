"""KV events in a real redis-server: the stream carries exactly the block hashes the pool stored
for a known prompt, under the instance's lease; serving goes on while Redis is down; after Redis
restarts, the publisher re-sends `cleared` and then the full set."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import redis
from servers import EngineServerProcess, RedisProcess, free_port, metric, wait_for

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.kv_events import AllCleared, BlockStored, from_fields
from kvharbor.common.redis_keys import lease_key, parse_registry_value, stream_key, stream_registry_key

pytestmark = pytest.mark.slow  # real `kvharbor serve` and redis-server

MODEL = "tiny-chat"
STREAM = stream_key(MODEL, "engine-a")
LEASE = lease_key(MODEL, "engine-a")


def read_events(client: redis.Redis, after: str = "-") -> list[tuple[str, object]]:
    return [(entry_id.decode(), from_fields(fields)) for entry_id, fields in client.xrange(STREAM, min=after)]


def dropped_events(url: str) -> float:
    return metric(httpx.get(url + "/metrics").text, "kvharbor_kv_events_dropped_total")


def tiny_engine_args(model: Path, redis_url: str) -> tuple[str, ...]:
    """`kvharbor serve` options for a small, fast engine publishing as instance engine-a."""
    return ("--model", str(model), "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
            "--redis-url", redis_url, "--instance-id", "engine-a")  # fmt: skip


def test_events_match_the_pool_and_survive_a_redis_restart(tmp_path, tiny_chat_model):
    redis_port = free_port()
    server_redis = RedisProcess(tmp_path / "redis", port=redis_port).start()
    proc = None
    try:
        url = server_redis.url
        args = (*tiny_engine_args(tiny_chat_model, url), "--lease-ttl", "5", "--log-level", "info")
        proc = EngineServerProcess(tmp_path, *args).start()
        client = redis.Redis.from_url(url)
        first = wait_for(lambda: read_events(client))
        assert isinstance(first[0][1].event, AllCleared)  # a fresh index learns the instance starts empty
        lease = wait_for(lambda: client.get(LEASE)).decode()
        registered = client.hget(stream_registry_key(), STREAM)  # where the KV cache service finds it
        assert parse_registry_value(registered) == (MODEL, "engine-a")
        assert 0 < client.pttl(LEASE) <= 5000

        ids = list(range(100, 140))  # 2 full blocks of 16 + 8 tokens
        body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "cache_salt": "tenant-a", "ignore_eos": True}
        assert httpx.post(proc.url + "/v1/completions", json=body, timeout=60).status_code == 200
        expected = block_hashes(ids, 16, MODEL, "tenant-a")[:2]
        stored = wait_for(lambda: [env for _, env in read_events(client) if isinstance(env.event, BlockStored)])
        assert [h for env in stored for h in env.event.hashes] == expected
        assert stored[0].event.parent is None and stored[0].event.block_size == 16
        assert {(env.instance, env.lease, env.model) for _, env in read_events(client)} == {("engine-a", lease, MODEL)}
        seqs = [env.seq for _, env in read_events(client)]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        # Redis goes away: serving goes on, and events are dropped and counted.
        server_redis.stop()
        other = {"model": MODEL, "prompt": list(range(300, 340)), "max_tokens": 2, "ignore_eos": True}
        assert httpx.post(proc.url + "/v1/completions", json=other, timeout=60).status_code == 200
        dropped = wait_for(lambda: dropped_events(proc.url))
        assert dropped == 1  # the one BlockStored of that request

        # A new, empty Redis on the same port: the publisher re-sends cleared + everything it holds.
        server_redis = RedisProcess(tmp_path / "redis2", port=redis_port).start()
        events = wait_for(
            lambda: [env for _, env in read_events(client) if isinstance(env.event, BlockStored)], timeout=40
        )
        replay = [env for _, env in read_events(client)]
        assert isinstance(replay[0].event, AllCleared)
        resent = {h for env in events for h in env.event.hashes}
        salted_other = block_hashes(list(range(300, 340)), 16, MODEL, None)[:2]
        assert resent == set(expected) | set(salted_other)
        assert wait_for(lambda: client.get(LEASE)).decode() == lease

        # The lease lapses (a stall longer than its TTL; the index may have swept us): the next
        # heartbeat notices and the publisher re-sends everything under the same lease.
        resyncs = len([1 for _, env in read_events(client) if isinstance(env.event, AllCleared)])
        client.delete(LEASE)
        wait_for(
            lambda: len([1 for _, env in read_events(client) if isinstance(env.event, AllCleared)]) > resyncs,
            timeout=10,
        )
        last_clear = max(i for i, (_, env) in enumerate(read_events(client)) if isinstance(env.event, AllCleared))
        after = wait_for(
            lambda: [env for _, env in read_events(client)[last_clear:] if isinstance(env.event, BlockStored)]
        )
        assert {h for env in after for h in env.event.hashes} == resent
        assert client.get(LEASE).decode() == lease
    finally:
        if proc is not None:
            proc.stop()
        server_redis.stop()


def test_graceful_stop_clears_the_instance_and_drops_its_lease(tmp_path, tiny_chat_model):
    with RedisProcess(tmp_path / "redis") as server_redis:
        client = redis.Redis.from_url(server_redis.url)
        args = (*tiny_engine_args(tiny_chat_model, server_redis.url), "--log-level", "warning")
        with EngineServerProcess(tmp_path, *args):
            wait_for(lambda: client.get(LEASE))
        assert client.get(LEASE) is None
        assert isinstance(read_events(client)[-1][1].event, AllCleared)
