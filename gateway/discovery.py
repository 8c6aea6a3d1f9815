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


# -- Kubernetes -----------------------------------------------------------------------------------

DISCOVERY_LABEL = "kvharbor.io/discovery"  # on engine Services, set by the operator (operator/objects.py)
MODEL_LABEL = "kvharbor.io/model"


def engines_from_slices(services: list[dict], slices: list[dict]) -> dict[str, list[str]]:
    """Ready engine URLs per model, from engine Services and their EndpointSlices (discovery.k8s.io/v1)."""
    models: dict[str, str] = {}
    for svc in services:
        meta = svc.get("metadata", {})
        labels = meta.get("labels") or {}
        if labels.get(DISCOVERY_LABEL) == "engine" and labels.get(MODEL_LABEL):
            models[f"{meta.get('namespace')}/{meta.get('name')}"] = labels[MODEL_LABEL]
    out: dict[str, list[str]] = {}
    for es in slices:
        meta = es.get("metadata", {})
        owner = f"{meta.get('namespace')}/{(meta.get('labels') or {}).get('kubernetes.io/service-name')}"
        model = models.get(owner)
        if model is None:
            continue
        port = next((p.get("port") for p in es.get("ports") or [] if p.get("name") in ("http", None)), None)
        if port is None:
            continue
        for ep in es.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False:
                continue
            for address in ep.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                out.setdefault(model, []).append(f"http://{host}:{port}")
    return {m: sorted(set(urls)) for m, urls in out.items()}


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
            ModelSpec(name, spec.files, tuple(found.get(name, ())), spec.slo_ttft_ms, spec.slo_itl_ms)
            for name, spec in sorted(self.specs.items())
        ]
        return self._current

    def models(self) -> list[ModelSpec]:
        return list(self._current)
