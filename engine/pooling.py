"""Embeddings from a decoder: what an engine whose task is `embed` returns instead of tokens.

A pooling request runs its prompt's prefill like any other (the same scheduler, chunks and KV
pool) and samples nothing: the runner takes the final-normed hidden state of its last token
(`last`, Qwen3-Embedding's) or the mean over all its tokens (`mean`), and the request ends.
`last` reuses the prefix cache like a generation (only the last token must be computed); `mean`
needs every token's hidden state, which the KV cache does not hold, so its prompt is computed
whole (it still leaves its blocks cached for others).

The task and pooling come from the model's files, as sentence-transformers lays them out
(`1_Pooling/config.json`, a Normalize module in `modules.json`), or from a config whose
architecture is a bare `...Model`; `--task` and `--pooling` override. The API server normalizes
(L2) and cuts to `dimensions` (Matryoshka: the first d values, normalized again).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

POOLING_MODES = ("last", "mean")
Task = Literal["generate", "embed"]


@dataclass(frozen=True)
class Pooling:
    mode: str = "last"
    normalize: bool = True


def model_pooling(folder: Path | None) -> Pooling | None:
    """The pooling a model folder declares; None for a generative model (or a GGUF file)."""
    if folder is None or not folder.is_dir():
        return None
    pooling_config = folder / "1_Pooling" / "config.json"
    modules = folder / "modules.json"
    normalize = modules.exists() and any("Normalize" in str(m.get("type", "")) for m in _json(modules) or [])
    if pooling_config.exists():
        config = _json(pooling_config) or {}
        mode = "mean" if config.get("pooling_mode_mean_tokens") else "last"
        return Pooling(mode, normalize or not modules.exists())
    architectures = (_json(folder / "config.json") or {}).get("architectures") or []
    if architectures and all(a.endswith("Model") for a in architectures):
        return Pooling("last", True)
    return None


def resolve_pooling(folder: Path | None, task: str, mode: str) -> Pooling | None:
    """The engine's pooling: None when it generates. `task` auto|generate|embed, `mode`
    auto|last|mean (auto: what the model declares, else last)."""
    declared = model_pooling(folder)
    if task == "generate" or (task == "auto" and declared is None):
        return None
    base = declared or Pooling()
    return Pooling(base.mode if mode == "auto" else mode, base.normalize)


def finish_vector(values: list[float], normalize: bool, dimensions: int | None) -> list[float]:
    """A pooled vector as the API returns it: cut to `dimensions`, then L2-normalized."""
    if dimensions is not None:
        values = values[:dimensions]
    if normalize:
        norm = math.sqrt(sum(v * v for v in values)) or 1.0
        values = [v / norm for v in values]
    return values


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
