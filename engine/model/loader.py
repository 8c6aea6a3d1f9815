"""Find and read a model: a GGUF file, a Hugging Face folder, or the bundled default (SmolLM2)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvharbor.common.model_files import resolve_model
from kvharbor.common.tokenizer import Tokenizer
from kvharbor.engine.model.arch import ModelArch
from kvharbor.engine.quantize import QuantWeight


@dataclass
class LoadedModel:
    name: str  # the served model id: API name and block-hash namespace
    path: Path
    arch: ModelArch
    state_dict: dict[str, torch.Tensor | QuantWeight]  # Hugging Face names; QuantWeight: kept GGUF blocks
    tokenizer: Tokenizer | None


def load_model(model: str | None, served_name: str | None = None, keep_blocks: bool = False) -> LoadedModel:
    """Read weights, architecture and tokenizer. `keep_blocks` (--quantization gguf): keep a GGUF
    file's quantized blocks (engine/model/gguf_loader.py). Raises FileNotFoundError/ValueError with a hint."""
    path, name = resolve_model(model, served_name)
    if path.suffix == ".gguf":
        return _load_gguf(path, name, keep_blocks)
    if keep_blocks:
        raise ValueError(
            f"--quantization gguf keeps a GGUF file's quantized blocks, and {path} is a Hugging Face folder: "
            "pass a .gguf file as --model, or use --quantization int8 or int4"
        )
    return _load_hf_dir(path, name)


def _load_gguf(path: Path, name: str, keep_blocks: bool) -> LoadedModel:
    from kvharbor.engine.model.gguf_loader import load_gguf

    gguf = load_gguf(path, keep_blocks)
    return LoadedModel(name, path, gguf.arch, gguf.state_dict, Tokenizer.from_gguf_metadata(gguf.metadata))


def _load_hf_dir(path: Path, name: str) -> LoadedModel:
    from safetensors.torch import load_file

    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a Hugging Face model folder: it has no config.json")
    config = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if gen_eos is not None:
            config = {**config, "eos_token_id": gen_eos}
    arch = ModelArch.from_hf_config(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights (PyTorch .bin files are not loaded, for safety)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if state and not any(k.startswith("model.") for k in state):  # a bare ...Model checkpoint (embedding models)
        state = {f"model.{k}": v for k, v in state.items()}
    if "lm_head.weight" not in state and not arch.tie_word_embeddings:
        # No head: an embedding model's, which pooling never uses; the embeddings stand in for it.
        arch = dataclasses.replace(arch, tie_word_embeddings=True)
    tokenizer = Tokenizer.from_hf_dir(path, arch.eos_token_ids, arch.bos_token_id)
    return LoadedModel(name, path, arch, state, tokenizer)
