"""The Helm chart renders (Helm's own library, from the helm-python-sdk wheel), lints clean in
strict mode, and every manifest validates strictly against Kubernetes 1.30 and 1.37 (and the
InferenceServices it may carry against our CRD)."""

from __future__ import annotations

import base64
import json
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
    "external-redis-secret": {"externalRedis": {"existingSecret": "my-redis", "existingSecretKey": "uri"}},
    "redis-auth-secret": {"redis": {"auth": {"existingSecret": "my-redis-auth"}}},
    "without-operator": {"operator": {"enabled": False}},
    "without-network-policies": {"networkPolicy": {"enabled": False}},
    "engines-elsewhere-monitored": {
        "gateway": {"discoveryNamespace": "models"},
        "networkPolicy": {"metrics": {"from": [{"namespaceSelector": {"matchLabels": {"team": "monitoring"}}}]}},
    },
}
# Where each case's parts read KVHARBOR_REDIS_URL: (Secret, key).
URL_SECRET = {
    "external-redis-secret": ("my-redis", "uri"),
    "redis-auth-secret": ("my-redis-auth", "url"),
}


@pytest.mark.parametrize("case", list(VALUES))
def test_chart_renders_valid_manifests(case):
    docs = render(VALUES[case])
    kinds = sorted(d["kind"] for d in docs)
    assert "Deployment" in kinds and "Service" in kinds
    assert ("StatefulSet" in kinds) == (not case.startswith("external-redis"))
    assert ("ClusterRole" in kinds) == (case != "without-operator")
    assert ("NetworkPolicy" in kinds) == (case != "without-network-policies")
    for doc in docs:
        for version in ("1.30", "1.37"):
            kubernetes_validate.validate(doc, version, strict=True)
    # Every part reads the URL from the one Secret, never from a value.
    containers = [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    refs = [e for c in containers for e in c.get("env", []) if e["name"] == "KVHARBOR_REDIS_URL"]
    assert len(refs) == (2 if case == "without-operator" else 3)
    name, key = URL_SECRET.get(case, ("kvh-redis", "url"))
    assert all(e == {"name": "KVHARBOR_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
               for e in refs)  # fmt: skip
    if case in URL_SECRET:  # the user's Secret: the chart makes none
        assert not [d for d in docs if d["kind"] == "Secret"]
    else:
        assert secrets(docs)[name, key].startswith("redis://")


def secrets(docs: list[dict], namespace: str = "inference") -> dict[tuple[str, str], str]:
    """(name, key) -> decoded value of the Secrets the chart renders into `namespace`."""
    return {(d["metadata"]["name"], k): base64.b64decode(v).decode() for d in docs
            if d["kind"] == "Secret" and d["metadata"].get("namespace", namespace) == namespace
            for k, v in d["data"].items()}  # fmt: skip


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
    from kvharbor.kvcache_service.config import KVCacheServiceConfig
    from kvharbor.operator.config import OperatorConfig

    docs = render({})
    url = {"KVHARBOR_REDIS_URL": secrets(docs)["kvh-redis", "url"]}  # as the kubelet fills it in
    operator = _config_of(_container(docs, "operator"), OperatorConfig, url)
    assert operator.tenants.tenants_secret == "kvh-tenants" and operator.tenants.tenants_namespace == "inference"
    assert operator.engine.redis_url == url["KVHARBOR_REDIS_URL"] and operator.server.host == "0.0.0.0"
    assert (operator.engine.engine_redis_secret, operator.engine.engine_redis_secret_key) == ("kvh-redis", "url")
    assert operator.engine.vllm_image == "vllm/vllm-openai:v0.32.0"
    gateway = _config_of(_container(docs, "gateway"), GatewayConfig, url)
    assert gateway.serving.discovery == "kubernetes" and gateway.serving.discovery_namespace == "inference"
    assert gateway.serving.vllm_priority  # the operator's vLLM pods run --scheduling-policy priority
    assert (gateway.server.port, gateway.server.admin_port) == (8000, 9090)
    assert gateway.tenancy.redis_url == url["KVHARBOR_REDIS_URL"]
    kvcache = _config_of(_container(docs, "kvcache"), KVCacheServiceConfig, url)
    assert (kvcache.server.port, kvcache.server.admin_port) == (8100, 9090)
    assert kvcache.intake.redis_url == url["KVHARBOR_REDIS_URL"]
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
        "gateway": {"discoveryNamespace": "models", "disaggregation": "off", "pdMinGainMs": 20,
                    "pdTransferTrustS": 30, "pdPrefillDeadlineS": 4},
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
    assert (routing.disaggregation, routing.pd_min_gain_ms, routing.pd_transfer_trust_s) == ("off", 20.0, 30.0)
    assert routing.pd_prefill_deadline_s == 4.0
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


# --- Redis credentials (issue 20) -----------------------------------------------------------------

PASSWORD_URL = "rediss://kvharbor:s3cret-pw@redis.example.com:6380/0"


@pytest.mark.parametrize(
    "values",
    [{}, {"externalRedis": {"url": PASSWORD_URL}}, {"gateway": {"discoveryNamespace": "models"}}],
    ids=["in-chart", "external-url", "engines-elsewhere"],
)
def test_no_redis_credential_appears_outside_its_secret(values):
    """Neither the password nor the URL that holds it is in any ConfigMap, arg or env value: only
    in the chart's Secret, which every part (and the operator's engines) reads it from."""
    from urllib.parse import urlsplit

    docs = render(values)
    url = secrets(docs)["kvh-redis", "url"]
    password = urlsplit(url).password
    assert password and len(password) >= 9
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        for secret in (password, url, base64.b64encode(password.encode()).decode()):
            assert secret not in text, f"{doc['kind']} {doc['metadata']['name']}"
    if "discoveryNamespace" in values.get("gateway", {}):  # the engines read a copy in their namespace
        assert secrets(docs, "models") == {("kvh-redis", "url"): url}
    else:
        assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["namespace"] != "inference"]


def test_the_in_chart_redis_requires_the_password_of_its_secret():
    import string
    from urllib.parse import urlsplit

    docs = render({})
    (redis,) = [d for d in docs if d["kind"] == "StatefulSet"]
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]  # the kubelet expands it
    ref = {"secretKeyRef": {"name": "kvh-redis", "key": "password"}}
    assert {e["name"]: e["valueFrom"] for e in container["env"]} == {"REDIS_PASSWORD": ref, "REDISCLI_AUTH": ref}
    assert container["readinessProbe"]["exec"]["command"] == ["sh", "-c", "redis-cli ping | grep -q PONG"]
    password = secrets(docs)["kvh-redis", "password"]
    assert len(password) == 32 and set(password) <= set(string.ascii_letters + string.digits)  # URL-safe
    url = urlsplit(secrets(docs)["kvh-redis", "url"])
    assert (url.scheme, url.password, url.hostname, url.port, url.path) == (
        "redis", password, "kvh-redis.inference.svc", 6379, "/0")  # fmt: skip
    # No password is written in the chart: offline (no Secret to look up and keep) each render makes one.
    assert secrets(render({}))["kvh-redis", "password"] != password
    # Or the user's Secret: redis-server and the parts read its two keys, the chart makes none.
    docs = render({"redis": {"auth": {"existingSecret": "mine", "existingSecretPasswordKey": "pw"}}})
    (redis,) = [d for d in docs if d["kind"] == "StatefulSet"]
    env = redis["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in env} == {"mine"}
    assert {e["valueFrom"]["secretKeyRef"]["key"] for e in env} == {"pw"}
    assert not [d for d in docs if d["kind"] == "Secret"]


# --- NetworkPolicies ---------------------------------------------------------------------------------


def _matches(selector: dict, labels: dict) -> bool:
    assert not selector.get("matchExpressions")  # the chart uses matchLabels only
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict, source: tuple[str, dict], policy_namespace: str) -> bool:
    namespace, labels = source
    assert "ipBlock" not in peer
    if "namespaceSelector" in peer:
        in_namespace = _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
    else:
        in_namespace = namespace == policy_namespace
    return in_namespace and _matches(peer.get("podSelector") or {}, labels)


def allowed(docs: list[dict], source: tuple[str, dict], target: tuple[str, dict], port: str) -> bool:
    """Whether the rendered NetworkPolicies let a pod (namespace, labels) connect to a named port
    of another: a pod no policy selects takes anything; else some rule of a policy that selects
    it must match the source and the port (no `from`: any source; no `ports`: any port)."""
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    selecting = [p for p in policies if p["metadata"].get("namespace", "inference") == target[0]
                 and _matches(p["spec"]["podSelector"], target[1])
                 and "Ingress" in p["spec"]["policyTypes"]]  # fmt: skip
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers, ports = rule.get("from"), rule.get("ports")
            namespace = policy["metadata"].get("namespace", "inference")
            if peers and not any(_peer_matches(peer, source, namespace) for peer in peers):
                continue
            if ports and not any(p["port"] == port for p in ports):
                continue
            return True
    return False


def _pods(docs: list[dict], engines: str = "inference") -> dict[str, tuple[str, dict]]:
    from kvharbor.operator.objects import engine_labels

    pods = {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]:
            ("inference", d["spec"]["template"]["metadata"]["labels"])
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}  # fmt: skip
    return pods | {
        "engine": (engines, engine_labels("llama-8b", "prefill")),
        "vllm-engine": (engines, {**engine_labels("qwen-vllm", "both"), "kvharbor.io/engine-kind": "vllm"}),
        "tenant": ("tenants", {"app": "client"}),
        "stranger": ("inference", {"app": "other"}),  # some other pod of the release namespace
        "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
        "other-monitoring": ("monitoring", {"app": "grafana"}),
    }


# target: port -> the sources allowed there (every other source is refused)
KVHARBOR = {"gateway", "operator", "kvcache", "engine", "vllm-engine"}
EVERYONE = KVHARBOR | {"redis", "tenant", "stranger", "prometheus", "other-monitoring"}
ENGINES = {"engine", "vllm-engine"}  # engine pods of either kind: their policy selects both
POLICY = {
    "gateway": {"http": EVERYONE, "admin": set()},
    "engine": {"http": {"gateway", "operator", *ENGINES}, "kv-transfer": ENGINES, "admin": {"operator"}},
    # and metrics scrapers on the bridge: its /metrics carries vLLM's
    "vllm-engine": {"http": {"gateway", "operator", *ENGINES}, "bridge": set()},
    "kvcache": {"http": KVHARBOR, "admin": {"operator"}},
    "redis": {"redis": KVHARBOR},
    "operator": {"health": set()},
}  # fmt: skip


@pytest.mark.parametrize(
    "values",
    [{}, {"gateway": {"discoveryNamespace": "models"}}, {"networkPolicy": {"metrics": {"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]}}}],
    ids=["default", "engines-elsewhere", "with-monitoring"],
)  # fmt: skip
def test_network_policies_let_in_only_what_each_part_needs(values):
    """Tenants reach the gateway's tenant port only; engines take the gateway, the operator and
    each other; Redis and the KV cache service take kvharbor's parts only; admin ports take the
    operator (engines, KV cache service) and networkPolicy.metrics.from, by default nobody."""
    engines = values.get("gateway", {}).get("discoveryNamespace", "inference")
    docs = render(values)
    pods = _pods(docs, engines)
    monitored = "networkPolicy" in values
    for target, ports in POLICY.items():
        for port, sources in ports.items():
            if monitored and (port == "admin" or (target, port) == ("vllm-engine", "bridge")):
                sources = sources | {"prometheus"}
            for source in EVERYONE:
                expected = source in sources
                assert allowed(docs, pods[source], pods[target], port) == expected, f"{source} -> {target}:{port}"
    # The ports the policies name are ports the pods declare.
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    declared = {c: {p["name"] for p in workloads[f"kvh-{c}"]["spec"]["template"]["spec"]["containers"][0]["ports"]}
                for c in ("gateway", "kvcache", "redis", "operator")}  # fmt: skip
    assert declared == {"gateway": {"http", "admin"}, "kvcache": {"http", "admin"}, "redis": {"redis"},
                        "operator": {"health"}}  # fmt: skip


def test_network_policies_follow_the_values():
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]
    docs = render({"externalRedis": {"existingSecret": "r"}, "operator": {"enabled": False}})
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy")
    assert names == ["kvh-engines", "kvh-gateway", "kvh-kvcache"]  # no in-chart Redis, no operator
    pods = _pods(docs)
    assert allowed(docs, pods["gateway"], pods["engine"], "http")
    assert allowed(docs, pods["engine"], pods["kvcache"], "http")
    assert not allowed(docs, pods["tenant"], pods["engine"], "http")


# --- Admin ports ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("admin_port", [None, 9191])
def test_metrics_are_on_admin_ports_the_services_leave_out(admin_port):
    values = {} if admin_port is None else {"gateway": {"adminPort": admin_port}, "kvcache": {"adminPort": admin_port}}
    docs = render(values)
    port = admin_port or 9090
    for part in ("gateway", "kvcache"):
        deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"kvh-{part}")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["args"][container["args"].index("--admin-port") + 1] == str(port)
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["admin"] == port
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}  # fmt: skip
        assert container["readinessProbe"]["httpGet"]["port"] == "http"  # the probes answer on both ports
        service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"kvh-{part}")
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]


def test_the_operator_runs_two_replicas_with_lease_rbac_for_leader_election():
    docs = render({})
    operator = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvh-operator")
    assert operator["spec"]["replicas"] == 2 and operator["spec"]["strategy"]["type"] == "RollingUpdate"
    container = operator["spec"]["template"]["spec"]["containers"][0]
    pod_name = next(e for e in container["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}  # the election identity
    from kvharbor.operator.config import OperatorConfig

    leader = _config_of(container, OperatorConfig).leader
    assert leader.leader_election and leader.lease_name == "kvh-operator" and leader.lease_namespace == ""
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kvh-operator-leader"]
    assert role["metadata"]["namespace"] == "inference"  # the release namespace: the operator's tenants_namespace
    (rule,) = [r for r in role["rules"] if "leases" in r["resources"]]
    assert rule["apiGroups"] == ["coordination.k8s.io"] and {"get", "create", "update", "patch"} <= set(rule["verbs"])
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["name"] == "kvh-operator-leader"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvh-operator", "namespace": "inference"}]
    one = next(d for d in render({"operator": {"replicas": 1}}) if d["metadata"]["name"] == "kvh-operator"
               and d["kind"] == "Deployment")  # fmt: skip
    assert one["spec"]["replicas"] == 1
