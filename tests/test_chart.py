"""The Helm chart renders (Helm's own library, from the helm-python-sdk wheel), lints clean in
strict mode, and every manifest validates strictly against Kubernetes 1.30 and 1.37 (and the
InferenceServices it may carry against our CRD)."""

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
    "without-operator": {"operator": {"enabled": False}},
}


@pytest.mark.parametrize("case", list(VALUES))
def test_chart_renders_valid_manifests(case):
    docs = render(VALUES[case])
    kinds = sorted(d["kind"] for d in docs)
    assert "Deployment" in kinds and "Service" in kinds
    assert ("StatefulSet" in kinds) == (case != "external-redis")
    assert ("ClusterRole" in kinds) == (case != "without-operator")
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
            assert container["readinessProbe"] and container["livenessProbe"]


def test_chart_lints_clean_in_strict_mode():
    report = helm_python.lint(CHART, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_ships_the_crds():
    names = sorted(yaml.safe_load(p.read_text())["metadata"]["name"] for p in (CHART / "crds").glob("*.yaml"))
    assert names == ["inferenceservices.kvharbor.io", "tenants.kvharbor.io"]


def _container(docs: list[dict], name: str) -> dict:
    deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"kvh-{name}")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _config_of(container: dict, cls: type, env: dict[str, str] | None = None):
    """What the command in the container would run with: its args and env through our own parser."""
    import os
    from unittest import mock

    from kvharbor.common.config import config_from_argv

    values = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e} | (env or {})
    with mock.patch.dict(os.environ, values):
        return config_from_argv(cls, container["args"][1:], "test", "test")


def test_the_chart_passes_options_its_commands_accept(tmp_path):
    from kvharbor.gateway.config import GatewayConfig
    from kvharbor.gateway.discovery import StaticDiscovery
    from kvharbor.operator.config import OperatorConfig

    docs = render({})
    operator = _config_of(_container(docs, "operator"), OperatorConfig)
    assert operator.tenants.tenants_secret == "kvh-tenants" and operator.tenants.tenants_namespace == "inference"
    assert operator.engine.redis_url == "redis://kvh-redis:6379/0" and operator.server.host == "0.0.0.0"
    gateway = _config_of(_container(docs, "gateway"), GatewayConfig)
    assert gateway.serving.discovery == "kubernetes" and gateway.serving.discovery_namespace == "inference"
    # The gateway's models file, from the chart's ConfigMap, is one it can read.
    models = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvh-gateway-models")
    (tmp_path / "models.yaml").write_text(models["data"]["models.yaml"])
    specs = StaticDiscovery.from_file(tmp_path / "models.yaml", 2000, 200, require_engines=False).models()
    assert [(s.name, s.engines, s.slo_ttft_ms) for s in specs] == [("SmolLM2-135M-Instruct", (), 2000.0)]


def test_inference_services_in_values_render_and_satisfy_the_crd():
    """The disaggregated example, given as a value, renders as is into the gateway's discovery
    namespace and satisfies the CRD; the gateway gets the P/D values as options it accepts."""
    import jsonschema
    from test_operator_manifests import spec_schema

    from kvharbor.gateway.config import GatewayConfig

    example = yaml.safe_load((CHART / "examples" / "inferenceservice-disaggregated.yaml").read_text())
    values = {
        "inferenceServices": [{"name": example["metadata"]["name"], "spec": example["spec"]}],
        "gateway": {"discoveryNamespace": "models", "disaggregation": "off", "pdMinGainMs": 20},
    }
    docs = render(values)
    (service,) = [d for d in docs if d["kind"] == "InferenceService"]
    assert service["metadata"]["name"] == "qwen-7b-pd" and service["metadata"]["namespace"] == "models"
    assert service["spec"] == example["spec"] and service["spec"]["disaggregation"]["prefill"]["replicas"] == 1
    jsonschema.validate(service, spec_schema("inferenceservices"))
    for doc in docs:
        if doc["kind"] != "InferenceService":
            kubernetes_validate.validate(doc, "1.37", strict=True)
    routing = _config_of(_container(docs, "gateway"), GatewayConfig).routing
    assert (routing.disaggregation, routing.pd_min_gain_ms) == ("off", 20.0)
    assert _config_of(_container(render({}), "gateway"), GatewayConfig).routing.disaggregation == "auto"
    assert not [d for d in render({}) if d["kind"] == "InferenceService"]  # none unless asked


def test_a_lora_inference_service_in_values_renders_and_satisfies_the_crd():
    """The LoRA example (spec.adapters of each source kind, spec.lora) given as a value renders
    as is and satisfies the CRD; so does the Tenant example that grants one of its adapters."""
    import jsonschema
    from test_operator_manifests import spec_schema

    example = yaml.safe_load((CHART / "examples" / "inferenceservice-lora.yaml").read_text())
    docs = render({"inferenceServices": [{"name": example["metadata"]["name"], "spec": example["spec"]}]})
    (service,) = [d for d in docs if d["kind"] == "InferenceService"]
    assert service["spec"] == example["spec"]
    assert [a["name"] for a in service["spec"]["adapters"]] == ["sql", "support-chat", "summarize"]
    assert {next(iter(a["source"])) for a in service["spec"]["adapters"]} == {"path", "configMap", "pvc"}
    jsonschema.validate(service, spec_schema("inferenceservices"))
    tenant = yaml.safe_load((CHART / "examples" / "tenant-lora.yaml").read_text())
    jsonschema.validate(tenant, spec_schema("tenants"))
    assert set(tenant["spec"]["adapters"]) <= {a["name"] for a in example["spec"]["adapters"]}
