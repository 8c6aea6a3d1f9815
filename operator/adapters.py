"""LoRA adapters of an InferenceService (issue 18): `spec.adapters` and `spec.lora` as the
engines load them, where each adapter's folder is mounted, how many placement counts, and what
the status says of them.

    spec.adapters: [{name, source}]   source: exactly one of
        path: /abs/folder              already there (in the image, or a volume the node mounts)
        configMap: NAME                a ConfigMap holding adapter_config.json and
                                       adapter_model.safetensors (binaryData; < 1 MiB in all)
        pvc: {claimName, subPath?}     a folder on a PersistentVolumeClaim
    spec.lora: {maxLoras: 4, maxLoraRank: 16, maxCpuLoras: max(8, adapters, maxLoras)}

A ConfigMap or PVC adapter is mounted read-only at /var/lib/kvharbor/adapters/<name> in every
engine pod of every role (prefill engines compute an adapter's KV, decode engines continue it);
the engine gets `lora: ["<name>=<folder>", ...]` with max_loras, max_lora_rank and
max_cpu_loras (always written, so that placement counts what the engine reserves:
ModelProfile.lora_bytes). Nothing LoRA is written for a service without adapters, so its
engine config stays as it was (no rollout on upgrade). The operator never reads an adapter's
files: a rank above maxLoraRank or a missing file is the engine's error (its pods do not get
ready). A ConfigMap's content is not watched: to roll new weights, point the adapter at a new
ConfigMap (or folder).

A bad spec raises ValueError naming the field, as operator/roles.py does: the CRD's schema
refuses most of it first, but the operator also gets objects no schema checked, and the schema
cannot see duplicate names (a list-map key is not checked by every client) or compare fields.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvharbor.common.load_report import LoadReport
from kvharbor.common.lora import check_adapter_name
from kvharbor.operator.spec_fields import known_fields, whole_number

ADAPTERS_DIR = "/var/lib/kvharbor/adapters"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what the engine reads (PEFT)
SOURCE_KINDS = ("path", "configMap", "pvc")
# The engine's defaults and bounds (engine/config.py LoRAConfig; the operator imports no engine code).
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16
DEFAULT_MAX_CPU_LORAS = 8
MAX_ADAPTERS = 64
LIMITS = {"maxLoras": 64, "maxLoraRank": 512, "maxCpuLoras": 1024}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class Adapter:
    name: str
    kind: str  # path | configMap | pvc
    folder: str  # what the engine reads: the given path, or where the volume is mounted
    source: str | None = None  # the ConfigMap's or the claim's name
    sub_path: str | None = None  # pvc: the folder inside the claim

    @property
    def volume(self) -> str | None:
        """The pod volume this adapter is mounted from (one per ConfigMap or claim), or None."""
        if self.kind == "path":
            return None
        digest = hashlib.sha256(f"{self.kind}/{self.source}".encode()).hexdigest()[:10]
        return f"adapters-{digest}"  # a DNS label whatever the source's name


@dataclass(frozen=True)
class LoraSpec:
    adapters: tuple[Adapter, ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS  # adapters an engine keeps loaded (the spec's, or more)

    def shape(self) -> dict[str, int]:
        """The EngineShape fields placement sizes LoRA by; none (LoRA off) without adapters."""
        if not self.adapters:
            return {}
        return {"lora_slots": self.max_loras, "lora_rank": self.max_lora_rank, "lora_loaded": self.max_cpu_loras}

    def engine_config(self) -> dict[str, Any]:
        """The engine config's LoRA keys (`kvharbor serve --lora NAME=PATH ...`); none without adapters."""
        if not self.adapters:
            return {}
        return {
            "lora": [f"{a.name}={a.folder}" for a in self.adapters],
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
        }

    def volumes(self) -> list[dict[str, Any]]:
        """Pod volumes of the ConfigMap and PVC adapters, one per source, sorted by name."""
        found: dict[str, dict[str, Any]] = {}
        for a in self.adapters:
            if a.kind == "configMap":
                items = [{"key": f, "path": f} for f in ADAPTER_FILES]
                found[a.volume] = {"name": a.volume, "configMap": {"name": a.source, "items": items}}
            elif a.kind == "pvc":
                found[a.volume] = {"name": a.volume, "persistentVolumeClaim": {"claimName": a.source, "readOnly": True}}
        return [found[name] for name in sorted(found)]

    def volume_mounts(self) -> list[dict[str, Any]]:
        mounts = []
        for a in self.adapters:
            if a.volume is None:
                continue
            mount = {"name": a.volume, "mountPath": a.folder, "readOnly": True}
            if a.sub_path:
                mount["subPath"] = a.sub_path
            mounts.append(mount)
        return mounts


def lora_spec(spec: Mapping[str, Any]) -> LoraSpec:
    """`spec.adapters` and `spec.lora` of an InferenceService. Raises ValueError naming the field."""
    raw = spec.get("adapters") or []
    if not isinstance(raw, list):
        raise ValueError("adapters must be a list of {name, source}")
    if len(raw) > MAX_ADAPTERS:
        raise ValueError(f"adapters lists {len(raw)} adapters; at most {MAX_ADAPTERS}")
    base = ((spec.get("model") or {}).get("name")) or None
    adapters: list[Adapter] = []
    for i, item in enumerate(raw):
        adapter = _adapter(i, item)
        if adapter.name in {a.name for a in adapters}:
            raise ValueError(f"adapters[{i}].name {adapter.name!r} appears twice: adapter names must be unique")
        if adapter.name == base:
            raise ValueError(
                f"adapters[{i}].name {adapter.name!r} is the base model's name: clients could not tell them apart"
            )
        adapters.append(adapter)
    lora = spec.get("lora") or {}
    if not isinstance(lora, Mapping):
        raise ValueError("lora must be an object (maxLoras, maxLoraRank, maxCpuLoras)")
    known_fields(lora, set(LIMITS), "lora")
    max_loras = _count(lora.get("maxLoras", DEFAULT_MAX_LORAS), "lora.maxLoras")
    rank = _count(lora.get("maxLoraRank", DEFAULT_MAX_LORA_RANK), "lora.maxLoraRank")
    if "maxCpuLoras" not in lora:
        return LoraSpec(tuple(adapters), max_loras, rank, max(DEFAULT_MAX_CPU_LORAS, len(adapters), max_loras))
    cpu = _count(lora["maxCpuLoras"], "lora.maxCpuLoras")
    if cpu < max_loras:
        raise ValueError(
            f"lora.maxCpuLoras ({cpu}) is below lora.maxLoras ({max_loras}): an adapter a step runs is one kept loaded"
        )
    if cpu < len(adapters):
        raise ValueError(f"lora.maxCpuLoras ({cpu}) is below the {len(adapters)} adapters: every one is kept loaded")
    return LoraSpec(tuple(adapters), max_loras, rank, cpu)


def _adapter(i: int, item: Any) -> Adapter:
    where = f"adapters[{i}]"
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be an object with name and source")
    known_fields(item, {"name", "source"}, where)
    try:
        name = check_adapter_name(item.get("name"))
    except ValueError as exc:
        raise ValueError(f"{where}.name: {exc}") from None
    where = f"adapters[{i}] ({name})"
    source = item.get("source")
    if not isinstance(source, Mapping) or len(source) != 1 or next(iter(source)) not in SOURCE_KINDS:
        given = sorted(source) if isinstance(source, Mapping) else source
        raise ValueError(f"{where}.source needs exactly one of path, configMap or pvc, got {given!r}")
    ((kind, value),) = source.items()
    mounted = f"{ADAPTERS_DIR}/{name}"
    if kind == "path":
        if not isinstance(value, str) or not value.startswith("/"):
            raise ValueError(f"{where}.source.path must be an absolute folder path, got {value!r}")
        return Adapter(name, kind, value.rstrip("/") or "/")
    if kind == "configMap":
        return Adapter(name, kind, mounted, _object_name(value, f"{where}.source.configMap"))
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}.source.pvc must be an object with claimName (and subPath)")
    known_fields(value, {"claimName", "subPath"}, f"{where}.source.pvc")
    claim = _object_name(value.get("claimName"), f"{where}.source.pvc.claimName")
    sub_path = value.get("subPath") or None
    if sub_path is not None and (
        not isinstance(sub_path, str) or sub_path.startswith("/") or ".." in sub_path.split("/")
    ):
        raise ValueError(f"{where}.source.pvc.subPath must be a relative path without '..', got {sub_path!r}")
    return Adapter(name, kind, mounted, claim, posixpath.normpath(sub_path) if sub_path else None)


def _object_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ValueError(f"{where} must name an object in the service's namespace (lowercase DNS name), got {value!r}")
    return value


def _count(value: Any, where: str) -> int:
    return whole_number(value, where, 1, LIMITS[where.rsplit(".", 1)[-1]])



def adapters_status(lora: LoraSpec, loads: Sequence[LoadReport]) -> list[dict[str, Any]]:
    """status.adapters: every configured adapter (in spec order), then any other an engine
    reports (loaded at run time), each with how many of the answering ready engines report it
    (`engines`) and the identities they report (`name@digest`; two while a rollout changes an
    adapter's weights)."""
    configured = [a.name for a in lora.adapters]
    reported = sorted({name for load in loads for name in load.lora_adapters} - set(configured))
    out = []
    for name in [*configured, *reported]:
        identities = sorted({load.lora_adapters[name] for load in loads if name in load.lora_adapters})
        engines = sum(1 for load in loads if name in load.lora_adapters)
        entry: dict[str, Any] = {"name": name, "engines": engines, "configured": name in configured}
        if identities:
            entry["identities"] = identities
        out.append(entry)
    return out
