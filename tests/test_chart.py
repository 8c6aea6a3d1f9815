"""The Helm chart renders (Helm's own library, from the helm-python-sdk wheel), lints clean in
strict mode, and every manifest validates strictly against Kubernetes 1.30 and 1.37."""

from __future__ import annotations

from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parent.parent / "charts" / "kvharbor"


def render(values: dict) -> list[dict]:
    chart = helm_python.Chart.load(CHART)
    out = chart.render(values, name="kvh", namespace="inference")
    return [doc for text in out.values() for doc in yaml.safe_load_all(text) if doc]


VALUES = {
    "default": {},
    "external-redis": {"externalRedis": {"url": "redis://my-redis:6379/0"}},
    "with-operator": {"operator": {"enabled": True}},
}


@pytest.mark.parametrize("case", list(VALUES))
def test_chart_renders_valid_manifests(case):
    docs = render(VALUES[case])
    kinds = sorted(d["kind"] for d in docs)
    assert "Deployment" in kinds and "Service" in kinds
    assert ("StatefulSet" in kinds) == (case != "external-redis")
    assert ("ClusterRole" in kinds) == (case == "with-operator")
    for doc in docs:
        for version in ("1.30", "1.37"):
            kubernetes_validate.validate(doc, version, strict=True)
    containers = [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    urls = {e["value"] for c in containers for e in c.get("env", []) if e["name"] == "KVHARBOR_REDIS_URL"}
    assert urls == ({"redis://my-redis:6379/0"} if case == "external-redis" else {"redis://kvh-redis:6379/0"})


def test_pods_run_unprivileged():
    for doc in render({"operator": {"enabled": True}}):
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert container["resources"]["requests"]
            if container["name"] != "operator":  # its health endpoint comes with `kvharbor operator`
                assert container["readinessProbe"] and container["livenessProbe"]


def test_chart_lints_clean_in_strict_mode():
    report = helm_python.lint(CHART, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_ships_the_crds():
    names = sorted(yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / "crds").glob("*.yaml"))
    assert names == ["inferenceservices.kvharbor.io", "tenants.kvharbor.io"]
