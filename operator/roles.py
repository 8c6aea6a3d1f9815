"""The engine roles an InferenceService runs: `RoleSpec` and `role_specs(spec)`.

Without `spec.disaggregation` a service runs one colocated role, `both`, shaped by the top-level
`replicas`, `autoscaling`, `resources` and `placement`. With it, it runs a `prefill` and a
`decode` role, each with its own Deployment, replicas, autoscaling bounds and metric, and its
own resources and node pool (fields of the role's `resources` / `placement` override the
service's, one by one); the top-level `replicas` and `autoscaling` then do not apply.

- prefill scales on queued prefill tokens per replica (`waiting_prefill_tokens` in /load).
  It may run 0 replicas: the gateway then prefills every request on a decode engine. Nothing
  scales it up from 0 (there is no engine to measure), so autoscale it with min >= 1.
- decode scales on KV use (`kv`, the default) or on the ITL SLO (`itl`: the decode step each
  engine predicts for its running batch, against `slo.itlP95Ms`). At least 1 replica: decode
  engines serve every request.

A role's bounds default to its `replicas` (a fixed count until `autoscaling` widens them), and
`replicas` is where it starts, so it must lie within them. A bad spec raises ValueError naming
the field: the CRD's schema refuses most of these first, but the operator also gets objects no
schema checked (and the schema cannot compare two fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvharbor.operator.spec_fields import known_fields, whole_number
from kvharbor.operator.vllm_pods import engine_kind

COLOCATED = "both"
ROLES = ("prefill", "decode")
ALL_ROLES = (COLOCATED, *ROLES)
MAX_REPLICAS = 1000

# Targets per replica. kv and slo are shares in (0, 1]; itl defaults to the spec's ITL SLO (ms).
DEFAULT_TARGETS = {"queue": 8.0, "kv": 0.8, "slo": 0.95, "prefill_tokens": 4096.0}
METRICS = {COLOCATED: ("queue", "kv", "slo"), "decode": ("kv", "itl")}
SHARE_METRICS = ("kv", "slo")
ROLE_FIELDS = {"replicas", "autoscaling", "resources", "placement"}
AUTOSCALING_FIELDS = {"prefill": {"min", "max", "target"}, "decode": {"min", "max", "target", "metric"}}
LOWEST = {"prefill": 0, "decode": 1}  # the fewest replicas each role may run


@dataclass(frozen=True)
class RoleSpec:
    role: str  # both | prefill | decode
    min_replicas: int
    max_replicas: int
    start_replicas: int  # when its Deployment does not exist yet
    metric: str  # queue | kv | slo | prefill_tokens | itl
    target: float
    resources: Mapping[str, Any]  # gpusPerReplica, gpuType
    placement: Mapping[str, Any]  # nodePool, tolerations

    def clamp(self, replicas: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, replicas))


def role_specs(spec: Mapping[str, Any]) -> tuple[RoleSpec, ...]:
    """The roles `spec` runs: (both,) or (prefill, decode). Raises ValueError on a bad spec,
    including one whose engine kind cannot run it (vLLM pods and disaggregation)."""
    engine_kind(spec)
    disaggregation = spec.get("disaggregation")
    if spec.get("task", "generate") not in ("generate", "embed"):
        raise ValueError(f"task must be generate or embed, got {spec.get('task')!r}")
    if spec.get("task") == "embed" and (disaggregation is not None or spec.get("adapters")):
        raise ValueError("task embed runs one prefill per input: it takes no disaggregation and no LoRA adapters")
    if disaggregation is None:
        return (colocated_role(spec),)
    if not isinstance(disaggregation, Mapping):
        raise ValueError("disaggregation must be an object with prefill and decode")
    unknown = set(disaggregation) - set(ROLES)
    if unknown or any(r not in disaggregation for r in ROLES):
        raise ValueError(f"disaggregation needs exactly prefill and decode, got {sorted(disaggregation)}")
    return tuple(disaggregated_role(spec, role, disaggregation[role]) for role in ROLES)


def colocated_role(spec: Mapping[str, Any]) -> RoleSpec:
    replicas, auto = _section(spec, "replicas"), _section(spec, "autoscaling")
    low, high = int(replicas.get("min", 1)), int(replicas.get("max", 1))
    if low > high:
        raise ValueError(f"replicas.min ({low}) is above replicas.max ({high}); set min <= max")
    metric = auto.get("metric", "queue")
    if metric not in METRICS[COLOCATED]:
        raise ValueError(f"autoscaling.metric must be queue, kv or slo, got {metric!r}")
    target = _target(spec, "autoscaling", metric, auto.get("target"))
    return RoleSpec(
        COLOCATED, low, high, low, metric, target, _section(spec, "resources"), spec.get("placement", {}) or {}
    )


def disaggregated_role(spec: Mapping[str, Any], role: str, raw: Any) -> RoleSpec:
    where = f"disaggregation.{role}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object with replicas (and autoscaling, resources, placement)")
    known_fields(raw, ROLE_FIELDS, where)
    if "replicas" not in raw:
        raise ValueError(f"{where}.replicas is required")
    replicas = _count(raw["replicas"], f"{where}.replicas", LOWEST[role])
    auto = raw.get("autoscaling") or {}
    if not isinstance(auto, Mapping):
        raise ValueError(f"{where}.autoscaling must be an object (min, max, target)")
    known_fields(auto, AUTOSCALING_FIELDS[role], f"{where}.autoscaling")
    low = _count(auto.get("min", replicas), f"{where}.autoscaling.min", LOWEST[role])
    high = _count(auto.get("max", replicas), f"{where}.autoscaling.max", LOWEST[role])
    if not low <= replicas <= high:
        raise ValueError(
            f"{where}.replicas ({replicas}) must lie within autoscaling.min ({low}) and autoscaling.max ({high})"
        )
    metric = "prefill_tokens" if role == "prefill" else auto.get("metric", "kv")
    if role == "decode" and metric not in METRICS["decode"]:
        raise ValueError(f"{where}.autoscaling.metric must be kv or itl, got {metric!r}")
    target = _target(spec, f"{where}.autoscaling", metric, auto.get("target"))
    resources = {**_section(spec, "resources"), **_mapping(raw, "resources", where)}
    placement = {**_section(spec, "placement"), **_mapping(raw, "placement", where)}
    return RoleSpec(role, low, high, replicas, metric, target, resources, placement)


def _target(spec: Mapping[str, Any], where: str, metric: str, given: Any) -> float:
    if given is None:
        itl = _section(spec, "slo").get("itlP95Ms", 200)
        return float(itl) if metric == "itl" else DEFAULT_TARGETS[metric]
    try:
        target = float(given)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.target must be a number, got {given!r}") from None
    if target <= 0 or (metric in SHARE_METRICS and target > 1):
        raise ValueError(f"{where}.target {target:g} does not fit metric {metric}: use a share in (0, 1]")
    return target


def _count(value: Any, where: str, lowest: int) -> int:
    return whole_number(value, where, lowest, MAX_REPLICAS)


def _section(spec: Mapping[str, Any], key: str) -> dict:
    return dict(spec.get(key) or {})


def _mapping(raw: Mapping[str, Any], key: str, where: str) -> dict:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}.{key} must be an object")
    return dict(value)
