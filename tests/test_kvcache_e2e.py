"""Two real engine servers (SmolLM2, CPU) publish KV events to a real 3-master Redis Cluster; a
real `kvharbor kvcache` indexes them and a real gateway routes by that index. Lookups name the
engine that holds a prefix; the gateway sends a tenant's repeated prefix to its holder; engine B
reuses engine A's prefill through the shared block store, token for token; bad blocks are
refused; an engine that dies without a word drops out when its lease expires. (The same parts on
one redis-server: tests/test_gateway.py, tests/test_server_redis.py.)"""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
from servers import EngineServerProcess, GatewayProcess, KVCacheServiceProcess, metric, wait_for, write_tenants

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.redis_client import connect_sync
from kvharbor.kvcache_service.block_store import BlockFormat, encode_block

pytestmark = pytest.mark.slow  # real engines, a Redis Cluster, the KV cache service and a gateway

MODEL = "SmolLM2-135M-Instruct"
ENGINE_ARGS = ("--dtype", "float32", "--num-kv-blocks", "512", "--lease-ttl", "2", "--max-num-batched-tokens", "512")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_cluster):
    redis_cluster.flush()
    logs = tmp_path_factory.mktemp("kvcache-e2e")
    url = redis_cluster.url
    write_tenants(logs / "tenants.yaml", [{"name": "acme", "key": "sk-acme"}])
    a = EngineServerProcess(logs, "--redis-url", url, "--instance-id", "A", "--kv-store-push", "all", *ENGINE_ARGS)
    b = EngineServerProcess(logs, "--redis-url", url, "--instance-id", "B", *ENGINE_ARGS)
    svc = KVCacheServiceProcess(logs, url, "--lease-sweep-interval", "0.5")
    procs = [a, b, svc]
    try:
        for proc in procs:
            proc.launch()
        for proc in procs:
            proc.wait_ready()
        gw = GatewayProcess(logs, "--engines", f"{a.url},{b.url}", "--tenants-file", str(logs / "tenants.yaml"),
                            "--redis-url", url)  # fmt: skip
        procs.append(gw.start())
        wait_for(lambda: httpx.get(gw.url + "/ready").status_code == 200, what="gateway sees engines")
        yield {"a": a, "b": b, "svc": svc, "gw": gw, "redis": connect_sync(url, timeout=5), "nodes": redis_cluster}
    finally:
        for proc in reversed(procs):
            proc.stop()


def prompt_ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 1000 for i in range(n)]


def complete(engine: EngineServerProcess, ids: list[int], **extra):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body=extra or None)


def lookup(svc, ids: list[int], salt: str | None = None) -> dict:
    body = {"model": MODEL, "token_ids": ids, "cache_salt": salt}
    return httpx.post(svc.url + "/lookup", json=body, timeout=10).json().get("matches", {})


def indexed_blocks(svc) -> int:
    return httpx.get(svc.url + "/stats", timeout=10).json()["index"]["blocks"]


def scrape(engine) -> str:
    return httpx.get(engine.admin_url + "/metrics", timeout=10).text


def prefilled(metrics_text: str) -> float:
    """Prompt tokens the engine computed (looked up in its prefix cache and not found there)."""
    queries = metric(metrics_text, "kvharbor_prefix_cache_queries_total")
    return queries - metric(metrics_text, "kvharbor_prefix_cache_hits_total")


def test_lookup_names_the_engine_that_served_the_prompt(cluster):
    ids = prompt_ids(1, 16 * 8 + 5)
    complete(cluster["a"], ids, cache_salt="tenant-x")
    # The served prompt and its 12 generated tokens fill 8 full blocks of the prompt (+1 with output).
    matches = wait_for(lambda: (m := lookup(cluster["svc"], ids, "tenant-x")).get("A") and m, what="index")
    assert matches == {"A": 8}  # B holds none of it
    assert lookup(cluster["svc"], ids, "tenant-y") == {}  # another tenant never matches


def test_the_gateway_routes_a_repeated_prefix_to_its_holder_through_the_cluster_index(cluster):
    gw = openai.OpenAI(base_url=cluster["gw"].url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)
    system = "You are a terse assistant for the harbor master's office. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who are you?"}]
    before = indexed_blocks(cluster["svc"])
    first = gw.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    tokens = first.usage.prompt_tokens
    wait_for(lambda: indexed_blocks(cluster["svc"]) >= before + tokens // 16, what="the prefix in the index")
    for question in ("Where is the pier?", "When is high tide?", "Who pays the fees?"):
        messages[1]["content"] = question
        resp = gw.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        # Only the engine that served the first request holds this tenant's prefix: a hit each time
        # means the gateway found it in the index on the cluster.
        assert resp.usage.prompt_tokens_details.cached_tokens >= (tokens // 16 - 2) * 16


def test_b_reuses_a_prefill_through_the_shared_store(cluster):
    a, b = cluster["a"], cluster["b"]
    shared = prompt_ids(2, 512)
    complete(a, [*shared, 1500, 1600, 1700])  # A computes the 512-token prefix and pushes it
    blocks = 512 // 16
    wait_for(lambda: metric(scrape(a), "kvharbor_kv_store_pushed_blocks_total") >= blocks, what="push")

    question = [*shared, 2500, 2600, 2700, 2800, 2900]
    before = scrape(b)
    pulled = complete(b, question, kv_prefix_source="shared")
    after = scrape(b)
    assert (
        metric(after, "kvharbor_kv_store_pulled_blocks_total") - metric(before, "kvharbor_kv_store_pulled_blocks_total")
        == blocks
    )
    assert prefilled(after) - prefilled(before) == len(question) - 512  # only the uncached tail was prefilled
    assert pulled.usage.prompt_tokens_details.cached_tokens == 512

    # B recomputing from scratch (another salt: nothing cached, nothing pulled) says the same.
    scratch = complete(b, question, cache_salt="from-scratch")
    assert scratch.usage.prompt_tokens_details.cached_tokens == 0
    assert pulled.choices[0].text == scratch.choices[0].text
    stats = wait_for(
        lambda: (
            (s := httpx.get(cluster["svc"].url + "/stats").json())["reuse"].get(MODEL, {}).get("requests_shared") and s
        ),
        what="reuse stats",
    )
    reuse = stats["reuse"][MODEL]
    assert reuse["blocks_shared"] >= blocks and reuse["bytes_pulled"] > 0 and reuse["requests_miss"] >= 1


@pytest.mark.parametrize("damage", ["checksum", "fingerprint"])
def test_a_bad_block_is_refused_and_the_engine_recomputes(cluster, damage):
    a, b, r = cluster["a"], cluster["b"], cluster["redis"]
    ids = prompt_ids(3 if damage == "checksum" else 4, 16 * 6 + 3)
    complete(a, ids)
    wait_for(lambda: metric(scrape(a), "kvharbor_kv_store_pushed_blocks_total") > 0, what="push")
    third = block_hashes(ids, 16, MODEL)[2]
    key = next(k for k in r.scan_iter(match=f"kvharbor:blk:*:{MODEL}:*") if k.decode().endswith(third.hex()))
    blob = r.get(key)
    if damage == "checksum":
        r.set(key, blob[:-1] + bytes([blob[-1] ^ 0xFF]))
    else:
        size = len(blob) - len(encode_block(BlockFormat(MODEL, "x", "l", "d", 0), third, b""))
        other = BlockFormat(MODEL, "other-weights", "l", "d", size)
        r.set(key, encode_block(other, third, blob[-size:]))  # wrong fingerprint (and layout)
    before = scrape(b)
    pulled = complete(b, ids, kv_prefix_source="shared")
    after = scrape(b)
    refused = metric(after, "kvharbor_kv_store_refused_blocks_total", f'reason="{damage}"')
    assert refused - metric(before, "kvharbor_kv_store_refused_blocks_total", f'reason="{damage}"') == 1
    pulled_blocks = metric(after, "kvharbor_kv_store_pulled_blocks_total") - metric(
        before, "kvharbor_kv_store_pulled_blocks_total"
    )
    assert pulled_blocks == 2  # the run stopped at the refused block
    assert pulled.usage.prompt_tokens_details.cached_tokens == 2 * 16
    scratch = complete(b, ids, cache_salt="scratch-" + damage)
    assert pulled.choices[0].text == scratch.choices[0].text


def test_a_master_killed_degrades_like_an_outage_then_the_index_recovers(cluster):
    """One of the 3 masters dies: every lookup touches its shards, so lookups answer 503 (the
    gateway routes by load, as in a Redis outage) and chats still work. It comes back empty:
    the service finds its shard markers gone, asks the engines to re-sync, and the index knows
    again a prefix A computed before the outage (only a re-sync can tell it)."""
    a, svc, nodes = cluster["a"], cluster["svc"], cluster["nodes"]
    ids = prompt_ids(6, 16 * 5 + 1)
    complete(a, ids, cache_salt="before-the-outage")
    wait_for(lambda: lookup(svc, ids, "before-the-outage").get("A") == 5, what="index")
    wide = {"model": MODEL, "token_ids": prompt_ids(7, 16 * 64), "cache_salt": "wide"}  # touches every shard
    nodes.kill(1)
    try:
        wait_for(lambda: httpx.post(svc.url + "/lookup", json=wide, timeout=10).status_code == 503, what="503")
        gw = openai.OpenAI(base_url=cluster["gw"].url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)
        reply = gw.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert reply.choices[0].message.content is not None  # served, routed by load
    finally:
        nodes.restart(1)
    wait_for(lambda: lookup(svc, ids, "before-the-outage").get("A") == 5, timeout=60, what="index rebuilt")
    assert httpx.get(svc.url + "/stats").json()["intake"]["resyncs_requested"] >= 1


def test_an_engine_that_dies_drops_out_when_its_lease_expires(cluster):
    a, svc = cluster["a"], cluster["svc"]
    ids = prompt_ids(5, 16 * 4 + 1)
    complete(a, ids)
    wait_for(lambda: lookup(svc, ids).get("A") == 4, what="index")
    a.signal(signal.SIGKILL)  # no cleared event, no lease deletion: only expiry can tell
    a.wait(10)
    wait_for(lambda: "A" not in lookup(svc, ids), timeout=15, what="lease expiry")
    assert lookup(svc, ids) == {}
    wait_for(
        lambda: [i["instance"] for i in httpx.get(svc.url + "/instances").json()["instances"]] == ["B"],
        what="sweep",
    )
