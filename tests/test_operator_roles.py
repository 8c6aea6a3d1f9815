"""Engine roles of an InferenceService (operator/roles.py): what spec.disaggregation reads as,
what the operator refuses, and that each role scales on its own engines' load only."""

from __future__ import annotations

import asyncio
import copy

import pytest

from kvharbor.common.load_report import LoadReport
from kvharbor.operator.config import OperatorConfig, ScalingConfig
from kvharbor.operator.reconcile import OperatorContext, Resource, autoscale, reconcile_service
from kvharbor.operator.roles import RoleSpec, role_specs
from kvharbor.operator.status import Outcome, rfc3339

MODEL = {"source": "/m", "name": "Llama-3.1-8B-Instruct"}
PD = {
    "model": MODEL,
    "resources": {"gpuType": "L4"},
    "placement": {"nodePool": "l4", "tolerations": [{"key": "team", "operator": "Exists"}]},
    "slo": {"itlP95Ms": 120},
    "disaggregation": {
        "prefill": {"replicas": 1, "autoscaling": {"max": 4}, "resources": {"gpuType": "H100"},
                    "placement": {"nodePool": "h100"}},
        "decode": {"replicas": 2, "autoscaling": {"min": 1, "max": 8, "metric": "itl"}},
    },
}  # fmt: skip


def test_no_disaggregation_is_one_colocated_role_as_before():
    (role,) = role_specs({"model": MODEL, "replicas": {"min": 2, "max": 5}, "autoscaling": {"metric": "kv"}})
    assert (role.role, role.min_replicas, role.max_replicas, role.start_replicas) == ("both", 2, 5, 2)
    assert (role.metric, role.target) == ("kv", 0.8)


def test_each_role_has_its_own_bounds_metric_resources_and_pool():
    prefill, decode = role_specs(PD)
    assert (prefill.role, prefill.min_replicas, prefill.max_replicas, prefill.start_replicas) == ("prefill", 1, 4, 1)
    assert (prefill.metric, prefill.target) == ("prefill_tokens", 4096.0)
    assert prefill.resources == {"gpuType": "H100"} and prefill.placement["nodePool"] == "h100"
    assert prefill.placement["tolerations"] == [{"key": "team", "operator": "Exists"}]  # the service's, kept
    assert (decode.role, decode.min_replicas, decode.max_replicas, decode.start_replicas) == ("decode", 1, 8, 2)
    assert (decode.metric, decode.target) == ("itl", 120.0)  # the ITL SLO
    assert decode.resources == {"gpuType": "L4"} and decode.placement["nodePool"] == "l4"  # the service's


def test_a_role_without_autoscaling_runs_its_replicas_and_prefill_may_run_none():
    spec = {"model": MODEL, "disaggregation": {"prefill": {"replicas": 0}, "decode": {"replicas": 3}}}
    prefill, decode = role_specs(spec)
    assert (prefill.min_replicas, prefill.max_replicas, decode.min_replicas, decode.max_replicas) == (0, 0, 3, 3)
    assert (decode.metric, decode.target) == ("kv", 0.8)


def _pd(**changes) -> dict:
    spec = copy.deepcopy(PD)
    for role, fields in changes.items():
        spec["disaggregation"][role] = fields
    return spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"model": MODEL, "disaggregation": {"prefill": {"replicas": 1}}}, "needs exactly prefill and decode"),
        ({"model": MODEL, "disaggregation": ["prefill", "decode"]}, "must be an object"),
        (_pd(decode={"replicas": 0}), r"disaggregation.decode.replicas must be a whole number in 1..1000, got 0"),
        (_pd(prefill={"replicas": -1}), r"disaggregation.prefill.replicas must be a whole number in 0..1000"),
        (_pd(prefill={"replicas": True}), "got True"),
        (_pd(prefill={"replicas": "2"}), "got '2'"),
        (_pd(decode={}), "disaggregation.decode.replicas is required"),
        (_pd(decode={"replicas": 2, "replica": 3}), "unknown field.*replica; known: autoscaling, placement"),
        (_pd(decode={"replicas": 1, "autoscaling": {"min": 2, "max": 4}}), r"replicas \(1\) must lie within"),
        (_pd(prefill={"replicas": 1, "autoscaling": {"metric": "kv"}}), "prefill.autoscaling has unknown field"),
        (_pd(decode={"replicas": 1, "autoscaling": {"metric": "queue"}}), "metric must be kv or itl, got 'queue'"),
        (_pd(decode={"replicas": 1, "autoscaling": {"target": 2}}), "target 2 does not fit metric kv"),
        (_pd(prefill={"replicas": 1, "autoscaling": {"target": 0}}), "target 0 does not fit"),
        (_pd(prefill={"replicas": 1, "resources": "H100"}), "disaggregation.prefill.resources must be an object"),
    ],
)
def test_a_bad_disaggregation_is_refused_with_the_field_named(spec, message):
    with pytest.raises(ValueError, match=message):
        role_specs(spec)


def test_the_operator_deploys_nothing_for_a_bad_spec_and_says_why():
    body = {"metadata": {"name": "pd", "namespace": "ns", "uid": "u"}, "spec": _pd(decode={"replicas": 0})}
    # An invalid spec is refused before the cluster is read: no API client is needed.
    outcome = asyncio.run(reconcile_service(OperatorContext(OperatorConfig(), None, None), body))
    placed = next(c for c in outcome.status["conditions"] if c["type"] == "Placed")
    assert (placed["status"], placed["reason"]) == ("False", "InvalidSpec")
    assert placed["message"].startswith("invalid spec: disaggregation.decode.replicas must be a whole number")
    assert outcome.status["phase"] == "Unplaceable" and "roles" not in outcome.status


class Patches:
    """The one Kube call autoscale makes: merge patches, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def merge_patch(self, url: str, patch: dict) -> dict:
        self.calls.append((url, patch))
        return {}


def _scale(role: RoleSpec, desired: int, loads: list[LoadReport], status: dict, now: float = 10_000.0):
    """One autoscaling pass of `role`: (replicas wanted, patches sent, its status fields, events)."""
    kube = Patches()
    ctx = OperatorContext(OperatorConfig(scaling=ScalingConfig(scale_up_cooldown=30, scale_down_cooldown=300)), kube,
                          None)  # fmt: skip
    res = Resource("pd", "ns", "u", 1, PD, status)
    outcome, fields = Outcome(), {}
    wanted = asyncio.run(autoscale(ctx, res, role, desired, loads, now, outcome, fields))
    return wanted, kube.calls, fields, [e.message for e in outcome.events]


# A prefill engine's own decode step (its first tokens) is slow: it must not count for decode's ITL.
PREFILL_BUSY = LoadReport(role="prefill", waiting_prefill_tokens=16384, decode_step_ms=400.0, kv_blocks_total=100,
                          kv_blocks_free=0)  # fmt: skip
DECODE_CALM = LoadReport(role="decode", running=4, decode_step_ms=110.0, kv_blocks_total=100, kv_blocks_free=20)


def test_each_role_scales_on_its_own_engines_only():
    prefill, decode = role_specs(PD)
    loads = [PREFILL_BUSY, DECODE_CALM, DECODE_CALM]
    wanted, calls, fields, events = _scale(prefill, 1, loads, {})
    assert wanted == 4  # 16384 queued prefill tokens against 4096 per replica: 4x, the max
    assert calls == [("/apis/apps/v1/namespaces/ns/deployments/pd-engine-prefill", {"spec": {"replicas": 4}})]
    assert events == ["prefill engines: 1 -> 4 replicas: prefill_tokens 16384.00 per replica, target 4096"]
    assert set(fields) == {"lastScaleTime"}
    # The decode engines are within their ITL SLO (110 ms of 120): the prefill queue moves nothing there.
    assert _scale(decode, 2, loads, {})[:2] == (2, [])


def test_a_decode_role_scales_on_the_itl_slo_and_kv_use():
    _, decode = role_specs(PD)
    slow = LoadReport(role="decode", running=8, decode_step_ms=240.0, kv_blocks_total=100, kv_blocks_free=90)
    wanted, calls, _, _ = _scale(decode, 2, [slow, slow, PREFILL_BUSY], {})
    assert wanted == 4 and calls[0][0].endswith("/deployments/pd-engine-decode")  # 240 ms against 120
    kv_spec = _pd(decode={"replicas": 2, "autoscaling": {"max": 8}})  # metric kv, target 0.8
    _, by_kv = role_specs(kv_spec)
    full = LoadReport(role="decode", kv_blocks_total=100, kv_blocks_free=0)
    assert _scale(by_kv, 2, [full, full], {})[0] == 3  # 100% used against 80%
    idle = LoadReport(role="decode", kv_blocks_total=100, kv_blocks_free=20)  # 80% used: at target
    assert _scale(by_kv, 2, [idle, PREFILL_BUSY], {})[0] == 2  # a full prefill engine is not a decode one


def test_one_roles_cool_down_does_not_hold_the_other():
    prefill, decode = role_specs(PD)
    just_now = rfc3339(10_000.0 - 5)
    status = {"roles": {"prefill": {"lastScaleTime": just_now}}}
    slow = LoadReport(role="decode", running=8, decode_step_ms=240.0, kv_blocks_total=100, kv_blocks_free=90)
    loads = [PREFILL_BUSY, slow]
    assert _scale(prefill, 1, loads, status)[:2] == (1, [])  # scaled 5 s ago: within its 30 s cool-down
    assert _scale(decode, 2, loads, status)[0] == 4  # its own last change is long ago
