"""Where the engines of each model are. `Discovery` is the interface; `StaticDiscovery` reads
flags or a models file. The operator issue adds a Kubernetes implementation (the EndpointSlices
of each InferenceService's engine Service) behind the same interface.

    models:                            # --models-file
      - name: SmolLM2-135M-Instruct    # the served model id (clients, engines, block hashes)
        files: null                    # .gguf / HF folder for the tokenizer; null = bundled SmolLM2
        engines: [http://127.0.0.1:8001, http://127.0.0.1:8002]
        slo: {ttft_p95_ms: 2000, itl_p95_ms: 200}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import yaml


@dataclass(frozen=True)
class ModelSpec:
    name: str | None  # None: take the name from the model files
    files: str | None
    engines: tuple[str, ...]
    slo_ttft_ms: float
    slo_itl_ms: float


class Discovery(Protocol):
    def models(self) -> list[ModelSpec]:
        """Every model and its engine URLs, as known now (called again to pick up changes)."""


def check_url(url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"engine URL {url!r} must look like http://HOST:PORT")
    return url.rstrip("/")


class StaticDiscovery:
    def __init__(self, specs: list[ModelSpec]) -> None:
        if not specs:
            raise ValueError("no models configured: pass --engines URL[,URL...] or --models-file FILE")
        for spec in specs:
            if not spec.engines:
                raise ValueError(
                    f"model {spec.name or spec.files or '(bundled)'} has no engines: pass --engines URL[,URL...] "
                    "or list them under 'engines:' in --models-file"
                )
        self._specs = specs

    def models(self) -> list[ModelSpec]:
        return list(self._specs)

    @classmethod
    def from_flags(
        cls, engines: str, files: str | None, name: str | None, ttft_ms: float, itl_ms: float
    ) -> StaticDiscovery:
        urls = tuple(check_url(u.strip()) for u in engines.split(",") if u.strip())
        return cls([ModelSpec(name, files, urls, ttft_ms, itl_ms)])

    @classmethod
    def from_file(cls, path: str | Path, ttft_ms: float, itl_ms: float) -> StaticDiscovery:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"models file {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"models file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("models"), list):
            raise ValueError(f"models file {path} must hold a mapping with a 'models' list")
        specs = []
        for i, raw in enumerate(data["models"]):
            if not isinstance(raw, dict) or not isinstance(raw.get("engines"), list):
                raise ValueError(f"models[{i}] in {path} needs an 'engines' list of URLs")
            slo = raw.get("slo") or {}
            specs.append(
                ModelSpec(
                    raw.get("name"),
                    raw.get("files"),
                    tuple(check_url(str(u)) for u in raw["engines"]),
                    float(slo.get("ttft_p95_ms", ttft_ms)),
                    float(slo.get("itl_p95_ms", itl_ms)),
                )
            )
        return cls(specs)
