"""Status conditions and drift detection of the operator: the pure parts under its handlers."""

from __future__ import annotations

from kvharbor.common.kube import drifted, path
from kvharbor.operator.status import parse_rfc3339, phase, rfc3339, set_condition, transition_events


def test_condition_keeps_its_transition_time_until_the_status_flips():
    conds = set_condition([], "Ready", False, "Waiting", "0/1", "2026-01-01T00:00:00Z")
    again = set_condition(conds, "Ready", False, "Waiting", "0/1", "2026-01-01T00:05:00Z")
    assert again == conds  # a pass that finds nothing new writes the same status
    flipped = set_condition(again, "Ready", True, "EnginesReady", "1/1", "2026-01-01T00:06:00Z")
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:06:00Z" and flipped[0]["status"] == "True"


def test_conditions_stay_in_a_fixed_order_and_phase_follows_them():
    now = rfc3339()
    conds = set_condition([], "Degraded", False, "Healthy", "", now)
    conds = set_condition(conds, "Placed", True, "Fits", "", now)
    conds = set_condition(conds, "Ready", True, "EnginesReady", "", now)
    assert [c["type"] for c in conds] == ["Ready", "Placed", "Degraded"]
    assert phase(conds) == "Ready"
    assert phase(set_condition(conds, "Progressing", True, "RollingOut", "", now)) == "Progressing"
    assert phase(set_condition(conds, "Degraded", True, "EnginesSilent", "", now)) == "Degraded"
    assert phase(set_condition(conds, "Placed", False, "NoFit", "", now)) == "Unplaceable"
    assert phase([]) == "Pending"


def test_every_transition_is_an_event_and_bad_ones_are_warnings():
    now = rfc3339()
    old = set_condition([], "Placed", True, "Fits", "pool a", now)
    new = set_condition(old, "Placed", False, "NoFit", "needs 40 GiB", now)
    new = set_condition(new, "Ready", True, "EnginesReady", "1/1", now)
    events = transition_events(old, new)
    assert [(e.type, e.reason) for e in events] == [("Normal", "EnginesReady"), ("Warning", "NoFit")]
    assert "needs 40 GiB" in events[1].message
    assert transition_events(new, new) == []


def test_rfc3339_round_trips():
    assert parse_rfc3339(rfc3339(1_700_000_000)) == 1_700_000_000
    assert parse_rfc3339("yesterday") is None and parse_rfc3339(None) is None


def test_drift_ignores_fields_the_api_server_added_but_not_changed_or_missing_ones():
    desired = {"spec": {"ports": [{"name": "http", "port": 8000}], "selector": {"a": "b"}}}
    actual = {"spec": {"ports": [{"name": "http", "port": 8000, "protocol": "TCP"}], "selector": {"a": "b"},
                       "clusterIP": "10.0.0.7"}}  # fmt: skip
    assert not drifted(desired, actual)
    assert drifted({"spec": {"replicas": 2}}, {"spec": {"replicas": 3}})
    assert drifted({"spec": {"tolerations": [{"key": "x"}]}}, {"spec": {"tolerations": []}})
    assert drifted({"metadata": {"labels": {"new": "1"}}}, {"metadata": {"labels": {}}})


def test_rest_paths():
    assert path("v1", "Node") == "/api/v1/nodes"
    assert path("apps/v1", "Deployment", "ns", "x") == "/apis/apps/v1/namespaces/ns/deployments/x"
    assert path("kvharbor.io/v1alpha1", "Tenant") == "/apis/kvharbor.io/v1alpha1/tenants"


def test_engine_pod_names_including_cut_ones():
    from kvharbor.operator.reconcile import is_engine_pod_name

    assert is_engine_pod_name("llama", "llama-engine-7d9f8c6b5-x2k4q")
    assert not is_engine_pod_name("llama", "llama-engine-x-engine-7d9f8c6b5-x2k4q")  # service "llama-engine-x"
    assert not is_engine_pod_name("llama", "llama-gateway-7d9f8c6b5-x2k4q")
    long = "a-very-long-inference-service-name-for-a-model"  # 46 characters
    pod = (f"{long}-engine-7d9f8c6b5-")[:58] + "x2k4q"  # what Kubernetes names the pod
    assert is_engine_pod_name(long, pod)
    longer = "x" * 60
    assert is_engine_pod_name(longer, (f"{longer}-engine-7d9f8c6b5-")[:58] + "abcde")
    assert not is_engine_pod_name(long, (f"{long}-engine-7d9f8c6b5-")[:58] + "X2K4Q")


def test_autoscaling_targets_default_per_metric_and_shares_must_fit():
    import pytest

    from kvharbor.operator.roles import role_specs

    def target(auto: dict) -> tuple[str, float]:
        (role,) = role_specs({"model": {"name": "m"}, "autoscaling": auto})
        return role.metric, role.target

    assert target({}) == ("queue", 8.0)
    assert target({"metric": "slo"}) == ("slo", 0.95)
    assert target({"metric": "kv", "target": 0.7}) == ("kv", 0.7)
    with pytest.raises(ValueError, match="share in"):
        target({"metric": "slo", "target": 8})


def test_engine_pods_of_either_role_are_the_services():
    from kvharbor.operator.reconcile import is_engine_pod_name

    assert is_engine_pod_name("llama", "llama-engine-prefill-7d9f8c6b5-x2k4q")
    assert is_engine_pod_name("llama", "llama-engine-decode-7d9f8c6b5-x2k4q")
    assert not is_engine_pod_name("llama", "llama-engine-embed-7d9f8c6b5-x2k4q")  # no such role
    # The service "llama-engine-prefill" (colocated) is another one, whose pods are not llama's.
    assert not is_engine_pod_name("llama", "llama-engine-prefill-engine-7d9f8c6b5-x2k4q")
    assert is_engine_pod_name("llama-engine-prefill", "llama-engine-prefill-engine-7d9f8c6b5-x2k4q")
    long = "a-very-long-inference-service-name-for-a-model"
    assert is_engine_pod_name(long, (f"{long}-engine-decode-7d9f8c6b5-")[:58] + "x2k4q")


def _res(spec: dict, status: dict | None = None):
    from kvharbor.operator.reconcile import Resource

    return Resource("pd", "ns", "u", 1, {"model": {"name": "m"}, **spec}, status or {})


PD = {"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 2, "autoscaling": {"max": 4}}}}


def test_a_disaggregated_service_reports_each_role_and_clears_the_colocated_fields():
    from kvharbor.operator.reconcile import mode_status

    res = _res(PD, {"placement": {"pool": "l4"}, "lastScaleTime": "2026-01-01T00:00:00Z", "desiredReplicas": 1})
    scaled = "2026-01-02T00:00:00Z"
    per_role = {"prefill": {"readyReplicas": 1, "desiredReplicas": 1},
                "decode": {"readyReplicas": 1, "desiredReplicas": 3, "lastScaleTime": scaled}}  # fmt: skip
    status = mode_status(res, per_role)
    assert status == {"roles": per_role, "readyReplicas": 2, "desiredReplicas": 4,
                      "placement": None, "lastScaleTime": None}  # fmt: skip
    # Back to colocated: the role numbers go, the top-level ones are the service's again.
    back = mode_status(_res({}, {"roles": per_role}), {"both": {"readyReplicas": 1, "desiredReplicas": 1}})
    assert back == {"readyReplicas": 1, "desiredReplicas": 1, "roles": None}
    assert mode_status(_res({}), {"both": {"desiredReplicas": 1}}) == {"desiredReplicas": 1}


def test_ready_needs_every_role_and_says_which_waits():
    from kvharbor.operator.reconcile import readiness
    from kvharbor.operator.roles import role_specs

    roles = role_specs(_res(PD).spec)
    deployments = {"prefill": {"status": {"readyReplicas": 1, "updatedReplicas": 1}},
                   "decode": {"status": {"readyReplicas": 0, "updatedReplicas": 2}}}  # fmt: skip
    conds = readiness([], roles, deployments, {"prefill": 1, "decode": 2}, [])
    ready = next(c for c in conds if c["type"] == "Ready")
    assert ready["status"] == "False" and "decode: 0/2 engine replicas ready (at least 2 needed)" in ready["message"]
    deployments["decode"]["status"]["readyReplicas"] = 2
    conds = readiness(conds, roles, deployments, {"prefill": 1, "decode": 2}, [])
    assert phase(conds) == "Ready"
