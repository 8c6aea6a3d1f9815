"""`kvharbor up --engine-kind vllm`: the local platform over vLLM-CPU servers, each with its
kv-bridge (issue 25), without processes: its options and command lines, and the bundled model
written out as the Hugging Face folder vLLM reads. tests/test_vllm_real.py runs it."""

from __future__ import annotations

import json
import shutil

import pytest

from kvharbor.common.config import ConfigError, load_config
from kvharbor.engine.model.loader import load_model
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
            assert bridge[bridge.index("--vllm-metrics-url") + 1] == children[f"vllm-{i}"].url + "/metrics"
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
