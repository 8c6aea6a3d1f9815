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

    from kvharbor.operator.reconcile import Resource, autoscaling_target

    def res(auto: dict) -> Resource:
        return Resource("s", "ns", "u", 1, {"model": {"name": "m"}, "autoscaling": auto}, {})

    assert autoscaling_target(res({})) == ("queue", 8.0)
    assert autoscaling_target(res({"metric": "slo"})) == ("slo", 0.95)
    assert autoscaling_target(res({"metric": "kv", "target": 0.7})) == ("kv", 0.7)
    with pytest.raises(ValueError, match="share in"):
        autoscaling_target(res({"metric": "slo", "target": 8}))
