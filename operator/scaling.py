"""Scaling decisions: how many engine replicas an InferenceService should run.

Like the Horizontal Pod Autoscaler: desired = ceil(current x observed / target), clamped to
[min, max], ignored within a 10% tolerance, and held by cool-downs (scale up no sooner than
`up_cooldown_s` after the last change, down no sooner than `down_cooldown_s`) so it does not flap.
Metrics, each a mean over the replicas' /load reports:
- `queue`: running + waiting requests
- `kv`: KV use, 0..1
- `slo`: share of requests meeting the SLO (target: the share wanted; lower is worse)
- `prefill_tokens`: prompt tokens queued or mid-prefill (`waiting_prefill_tokens`), how a
  role-prefill pool is sized
- `itl`: the decode step (ms) each engine predicts for the batch it runs now, against the ITL SLO;
  engines that have not measured a decode step yet give no data. A decode engine's step keeps
  its last value while idle, so the step predicted for its current batch, not the last measured
  one, is what lets an idle pool scale down.
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
    metric: str  # queue | kv | slo | prefill_tokens | itl
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
    elif metric == "prefill_tokens":
        values = [r.waiting_prefill_tokens for r in loads]
    elif metric == "itl":
        values = [1000 * r.decode_step_s_at(r.running) for r in loads if r.decode_step_ms]
    else:
        raise ValueError(f"unknown autoscaling metric {metric!r}: queue, kv, slo, prefill_tokens or itl")
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
