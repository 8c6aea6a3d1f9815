"""Scaling decisions (DESIGN §6): how many engine replicas an InferenceService should run.

Like the Horizontal Pod Autoscaler: desired = ceil(current x observed / target), clamped to
[min, max], ignored within a 10% tolerance, and held by cool-downs (scale up no sooner than
`up_cooldown_s` after the last change, down no sooner than `down_cooldown_s`) so it does not flap.
Metrics: `queue` (running + waiting requests per replica), `kv` (KV use per replica, 0..1) or
`slo` (share of requests meeting the SLO; target is the share wanted, lower is worse).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvharbor.common.load_report import LoadReport

TOLERANCE = 0.10


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    metric: str  # queue | kv | slo
    target: float
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 300.0


def observed(metric: str, loads: Sequence[LoadReport]) -> float | None:
    """The metric's mean over the replicas' /load reports (None without any)."""
    if not loads:
        return None
    if metric == "queue":
        values = [r.queue for r in loads]
    elif metric == "kv":
        values = [1 - r.kv_free_fraction for r in loads if r.kv_blocks_total]
    elif metric == "slo":
        values = [r.slo_attainment for r in loads if r.slo_attainment is not None]
    else:
        raise ValueError(f"unknown autoscaling metric {metric!r}: queue, kv or slo")
    return sum(values) / len(values) if values else None


def scale_decision(value: float | None, spec: AutoscalingSpec, current: int, now: float, last_change: float) -> int:
    """Replicas to run: `value` is the observed metric (mean per replica), `current` the replicas now."""
    clamped = min(spec.max_replicas, max(spec.min_replicas, current))
    if clamped != current or value is None or spec.target <= 0:
        return clamped  # out of bounds is fixed at once; no data changes nothing
    ratio = spec.target / max(value, 1e-9) if spec.metric == "slo" else value / spec.target
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    desired = min(spec.max_replicas, max(spec.min_replicas, math.ceil(current * ratio)))
    since = now - last_change
    if desired > current and since < spec.up_cooldown_s:
        return current
    if desired < current and since < spec.down_cooldown_s:
        return current
    return desired
