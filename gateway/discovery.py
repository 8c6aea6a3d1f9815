"""Where the engines of each model are. `Discovery` is the interface; `StaticDiscovery` reads
flags or a models file. The operator issue adds a Kubernetes implementation (the EndpointSlices
of each InferenceService's engine Service) behind the same interface.

    models:                            # --models-file
      - name: SmolLM2-135M-Instruct    # the served model id (clients, engines, block hashes)
        files: null                    # .gguf / HF folder for the tokenizer; null = bundled SmolLM2
        engines: [http://127.0.0.1:8001, http://127.0.0.1:8002]
        slo: {ttft_p95_ms: 2000, itl_p95_ms: 200}
        task: generate                 # or embed: its engines serve /v1/embeddings (gateway/embeddings.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import yaml

from kvharbor.common.endpoint_slices import (
    DISCOVERY_LABEL,
    SERVICE_NAME_LABEL,
    service_engine_kind,
    service_model,
    service_urls,
)


@dataclass(frozen=True)
class ModelSpec:
    name: str | None  # None: take the name from the model files
    files: str | None
    engines: tuple[str, ...]
    slo_ttft_ms: float
    slo_itl_ms: float
    block_size: int | None = None  # tokens per KV block, if the models file pins it (else the engines')
    task: str = "generate"  # generate | embed: what its engines serve (kvharbor engines also say so in /load)


class Discovery(Protocol):
    def models(self) -> list[ModelSpec]:
        """Every model and its engine URLs, as known now (called again to pick up changes)."""


def check_url(url: str) -> str:
    if url.startswith("vllm+"):  # a vLLM server: vllm+http://HOST:PORT#instance-id (gateway/engines.py)
        from kvharbor.gateway.engines import parse_engine

        parse_engine(url)
        return url
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"engine URL {url!r} must look like http://HOST:PORT")
    return url.rstrip("/")


class StaticDiscovery:
    def __init__(self, specs: list[ModelSpec], require_engines: bool = True) -> None:
        if not specs:
            raise ValueError("no models configured: pass --engines URL[,URL...] or --models-file FILE")
        for spec in specs:
            if require_engines and not spec.engines:
                raise ValueError(
                    f"model {spec.name or spec.files or '(bundled)'} has no engines: pass --engines URL[,URL...] "
                    "or list them under 'engines:' in --models-file"
                )
        self._specs = specs

    def models(self) -> list[ModelSpec]:
        return list(self._specs)

    @classmethod
    def from_flags(
        cls, engines: str, files: str | None, name: str | None, ttft_ms: float, itl_ms: float, require_engines=True
    ) -> StaticDiscovery:
        urls = tuple(check_url(u.strip()) for u in engines.split(",") if u.strip())
        return cls([ModelSpec(name, files, urls, ttft_ms, itl_ms)], require_engines)

    @classmethod
    def from_file(cls, path: str | Path, ttft_ms: float, itl_ms: float, require_engines=True) -> StaticDiscovery:
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
            engines = raw.get("engines", None if require_engines else []) if isinstance(raw, dict) else None
            if not isinstance(engines, list):
                raise ValueError(f"models[{i}] in {path} needs an 'engines' list of URLs")
            slo = raw.get("slo") or {}
            block_size = raw.get("block_size")
            whole = isinstance(block_size, int) and not isinstance(block_size, bool)
            if block_size is not None and not (whole and block_size > 0):
                raise ValueError(f"models[{i}].block_size in {path} must be a positive integer, got {block_size!r}")
            task = raw.get("task", "generate")
            if task not in ("generate", "embed"):
                raise ValueError(f"models[{i}].task in {path} must be generate or embed, got {task!r}")
            specs.append(
                ModelSpec(
                    raw.get("name"),
                    raw.get("files"),
                    tuple(check_url(str(u)) for u in engines),
                    float(slo.get("ttft_p95_ms", ttft_ms)),
                    float(slo.get("itl_p95_ms", itl_ms)),
                    block_size,
                    task,
                )
            )
        return cls(specs, require_engines)


# -- Kubernetes -----------------------------------------------------------------------------------


def engines_from_slices(services: list[dict], slices: list[dict]) -> dict[str, list[str]]:
    """Ready engine URLs per model, from engine Services and their EndpointSlices (discovery.k8s.io/v1)."""
    models: dict[str, str] = {}
    kinds: dict[str, str] = {}
    for svc in services:
        meta = svc.get("metadata", {})
        model, key = service_model(svc), f"{meta.get('namespace')}/{meta.get('name')}"
        if model:
            models[key], kinds[key] = model, service_engine_kind(svc)
    by_service: dict[str, list[dict]] = {}
    for es in slices:
        meta = es.get("metadata", {})
        owner = f"{meta.get('namespace')}/{(meta.get('labels') or {}).get(SERVICE_NAME_LABEL)}"
        if owner in models:
            by_service.setdefault(owner, []).append(es)
    out: dict[str, set[str]] = {}
    for owner, owned in by_service.items():
        out.setdefault(models[owner], set()).update(service_urls(owned, kind=kinds[owner]))
    return {m: sorted(urls) for m, urls in out.items()}


class KubernetesDiscovery:
    """Engines from the cluster: Services labelled `kvharbor.io/discovery=engine` and their
    EndpointSlices, re-read by `refresh()`. `api_get(path) -> dict` is the API access (in the
    gateway: the in-cluster service account over HTTPS); model files and SLOs come from `specs`."""

    def __init__(self, api_get, namespace: str, specs: dict[str, ModelSpec]) -> None:
        self.api_get = api_get
        self.namespace = namespace
        self.specs = specs  # model name -> tokenizer files and SLOs (engines are filled in here)
        self._current: list[ModelSpec] = []

    async def refresh(self) -> list[ModelSpec]:
        base = f"/api/v1/namespaces/{self.namespace}/services?labelSelector={DISCOVERY_LABEL}%3Dengine"
        services = (await self.api_get(base)).get("items", [])
        slices = (await self.api_get(f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices")).get(
            "items", []
        )
        found = engines_from_slices(services, slices)
        self._current = [
            ModelSpec(name, spec.files, tuple(found.get(name, ())), spec.slo_ttft_ms, spec.slo_itl_ms, spec.block_size,
                      spec.task)
            for name, spec in sorted(self.specs.items())
        ]
        return self._current

    def models(self) -> list[ModelSpec]:
        return list(self._current)
