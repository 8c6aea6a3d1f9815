"""The operator's objects and CRDs are valid Kubernetes (kubernetes-validate, strict, 1.30 and
1.37); the example CRs satisfy our CRDs' own schemas; desired_objects is pure and rolls on change;
a disaggregated service is a Deployment per role behind the one engine Service."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvharbor.operator.model_profiles import KNOWN
from kvharbor.operator.objects import desired_objects
from kvharbor.operator.placement import EngineShape, Pool, place
from kvharbor.operator.roles import role_specs

CHART = Path(__file__).resolve().parent.parent / "charts" / "kvharbor"
VERSIONS = ("1.30", "1.37")
L4 = Pool("l4", "NVIDIA-L4", 23034 << 20, 4, 3)
H100 = Pool("h100", "NVIDIA-H100-80GB-HBM3", 81559 << 20, 8, 2)
EXAMPLES = [
    "inferenceservice", "inferenceservice-disaggregated", "inferenceservice-lora", "inferenceservice-gemma3",
    "inferenceservice-vllm", "tenant", "tenant-lora",
]  # fmt: skip


def example(kind: str) -> dict:
    return yaml.safe_load((CHART / "examples" / f"{kind}.yaml").read_text())


def crd(plural: str) -> dict:
    return yaml.safe_load((CHART / "crds" / f"{plural}.yaml").read_text())


def objects_for(spec: dict) -> list[dict]:
    model = spec["model"]
    shape = EngineShape(model.get("dtype", "bfloat16"), model.get("maxModelLen", 4096), spec["engine"]["maxNumSeqs"])
    plan = place(KNOWN[model["name"]], shape, [L4])
    return desired_objects(
        "llama-8b", "inference", "uid-1", spec, plan, 2, "kvharbor/engine:0.1.0", "redis://redis:6379/0"
    )


def pd_objects(spec: dict, **kwargs) -> list[dict]:
    """desired_objects of a disaggregated spec, each role placed on its own pool as reconcile does."""
    model = spec["model"]
    shape = EngineShape(model.get("dtype", "bfloat16"), model.get("maxModelLen", 4096), spec["engine"]["maxNumSeqs"])
    plans = {
        role.role: place(KNOWN[model["name"]], shape, [L4, H100], gpu_type=role.resources.get("gpuType"))
        for role in role_specs(spec)
    }
    replicas = {"prefill": 1, "decode": 3}
    return desired_objects(
        "qwen-7b-pd", "inference", "uid-1", spec, plans, replicas, "kvharbor/engine:0.1.0", "redis://redis:6379/0",
        **kwargs,
    )


def by_name(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", ["inferenceservice", "inferenceservice-disaggregated"])
def test_desired_objects_are_valid_kubernetes(version, kind):
    spec = example(kind)["spec"]
    objs = objects_for(spec) if kind == "inferenceservice" else pd_objects(spec)
    if kind == "inferenceservice":
        assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"]
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)
        owner = obj["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", "uid-1", True)


def test_the_deployment_is_what_a_gpu_engine_needs():
    spec = example("inferenceservice")["spec"]
    deployment = objects_for(spec)[1]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"  # 15 GiB weights + 32 GiB KV (32 x 8192 x 128 KiB)
    assert pod["nodeSelector"] == {"kvharbor.io/pool": "l4"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["terminationGracePeriodSeconds"] > 30  # longer than the engine's drain
    service = objects_for(spec)[2]
    assert service["metadata"]["labels"]["kvharbor.io/discovery"] == "engine"
    config = yaml.safe_load(objects_for(spec)[0]["data"]["engine.yaml"])
    assert config["served_model_name"] == "Llama-3.1-8B-Instruct" and config["max_num_seqs"] == 32


def test_desired_objects_are_pure_and_roll_on_a_spec_change():
    spec = example("inferenceservice")["spec"]
    assert objects_for(spec) == objects_for(copy.deepcopy(spec))  # reconciling twice changes nothing
    changed = copy.deepcopy(spec)
    changed["engine"]["maxNumSeqs"] = 16
    before, after = objects_for(spec)[1], objects_for(changed)[1]
    key = "kvharbor.io/rollout-hash"
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != after["spec"]["template"]["metadata"]["annotations"][key]
    )


def test_disaggregation_is_a_deployment_per_role_behind_one_engine_service():
    objs = pd_objects(example("inferenceservice-disaggregated")["spec"])
    names = by_name(objs)
    assert sorted(names) == [
        ("ConfigMap", "qwen-7b-pd-engine-decode-config"), ("ConfigMap", "qwen-7b-pd-engine-prefill-config"),
        ("Deployment", "qwen-7b-pd-engine-decode"), ("Deployment", "qwen-7b-pd-engine-prefill"),
        ("PodDisruptionBudget", "qwen-7b-pd-engine-decode"), ("PodDisruptionBudget", "qwen-7b-pd-engine-prefill"),
        ("Service", "qwen-7b-pd"),
    ]  # fmt: skip
    prefill, decode = names["Deployment", "qwen-7b-pd-engine-prefill"], names["Deployment", "qwen-7b-pd-engine-decode"]
    service = names["Service", "qwen-7b-pd"]
    for role, dep in (("prefill", prefill), ("decode", decode)):
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["metadata"]["labels"]["kvharbor.io/role"] == role and pod_labels["kvharbor.io/role"] == role
        assert dep["spec"]["selector"]["matchLabels"]["kvharbor.io/role"] == role
        # The gateway's discovery: the one engine Service selects the engines of both roles.
        assert service["spec"]["selector"].items() <= pod_labels.items()
        pdb = names["PodDisruptionBudget", dep["metadata"]["name"]]
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    other = decode["spec"]["template"]["metadata"]["labels"]
    assert not prefill["spec"]["selector"]["matchLabels"].items() <= other.items()  # no overlap
    assert service["metadata"]["labels"]["kvharbor.io/discovery"] == "engine"
    assert service["metadata"]["labels"]["kvharbor.io/roles"] == "prefill-decode"
    assert service["metadata"]["annotations"]["kvharbor.io/model-name"] == "Qwen2.5-7B-Instruct"
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (1, 3)


def test_each_role_gets_its_own_placement_ports_and_engine_config():
    objs = by_name(pd_objects(example("inferenceservice-disaggregated")["spec"]))
    prefill, decode = (objs["Deployment", f"qwen-7b-pd-engine-{r}"]["spec"]["template"] for r in ("prefill", "decode"))
    # Qwen2.5-7B: 14 GiB weights + 14 GiB KV (32 x 8192 at 56 KiB): one H100, or two L4s.
    assert prefill["spec"]["nodeSelector"] == {"kvharbor.io/pool": "h100"}
    assert prefill["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert decode["spec"]["nodeSelector"] == {"kvharbor.io/pool": "l4"}
    assert decode["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    ports = {r: {p["name"]: p["containerPort"] for p in t["spec"]["containers"][0]["ports"]}
             for r, t in (("prefill", prefill), ("decode", decode))}  # fmt: skip
    assert ports == {"prefill": {"http": 8000, "admin": 9090, "kv-transfer": 8200},
                     "decode": {"http": 8000, "admin": 9090}}  # fmt: skip
    configs = {r: yaml.safe_load(objs["ConfigMap", f"qwen-7b-pd-engine-{r}-config"]["data"]["engine.yaml"])
               for r in ("prefill", "decode")}  # fmt: skip
    assert (configs["prefill"]["role"], configs["prefill"]["kv_transfer_port"]) == ("prefill", 8200)
    assert configs["decode"]["role"] == "decode" and "kv_transfer_port" not in configs["decode"]
    for template in (prefill, decode):  # each pod mounts its own role's config
        volume = template["spec"]["volumes"][0]["configMap"]["name"]
        assert yaml.safe_load(objs["ConfigMap", volume]["data"]["engine.yaml"])["role"] in volume


def test_a_colocated_service_keeps_its_names_and_engine_config():
    objs = by_name(objects_for(example("inferenceservice")["spec"]))
    assert sorted(objs) == [("ConfigMap", "llama-8b-engine-config"), ("Deployment", "llama-8b-engine"),
                            ("PodDisruptionBudget", "llama-8b-engine"), ("Service", "llama-8b")]  # fmt: skip
    deployment = objs["Deployment", "llama-8b-engine"]
    assert "kvharbor.io/role" not in deployment["spec"]["template"]["metadata"]["labels"]  # no rollout on upgrade
    config = yaml.safe_load(objs["ConfigMap", "llama-8b-engine-config"]["data"]["engine.yaml"])
    assert "role" not in config and "kv_transfer_port" not in config  # the engine's default: both
    assert objs["Service", "llama-8b"]["metadata"]["labels"]["kvharbor.io/roles"] == "both"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("plural", ["inferenceservices", "tenants"])
def test_crds_are_valid_kubernetes(plural, version):
    kubernetes_validate.validate(crd(plural), version, strict=True)


def _json_schema(openapi: dict, strict: bool = False) -> dict:
    """OpenAPI v3 (Kubernetes flavour) to JSON Schema: `nullable` becomes a null type. `strict`
    refuses unknown fields, as the API server's strict field validation does (kubectl's default);
    other clients get them pruned instead."""
    out = {}
    for key, value in openapi.items():
        if isinstance(value, dict):
            if key == "properties":
                value = {k: _json_schema(v, strict) for k, v in value.items()}
            else:
                value = _json_schema(value, strict)
        out[key] = value
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if strict and "properties" in out and not out.pop("x-kubernetes-preserve-unknown-fields", False):
        out["additionalProperties"] = False
    return out


def spec_schema(plural: str) -> dict:
    """The JSON Schema of a whole object: the CRD's, strict below the root (apiVersion, kind and
    metadata are the API server's, not the CRD's)."""
    root = crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return {**root, "properties": {k: _json_schema(v, strict=True) for k, v in root["properties"].items()}}


def plural_of(kind: str) -> str:
    return "tenants" if kind.startswith("tenant") else "inferenceservices"


@pytest.mark.parametrize("kind", EXAMPLES)
def test_examples_satisfy_our_crds(kind):
    schema = spec_schema(plural_of(kind))
    jsonschema.validate(example(kind), schema)
    broken = copy.deepcopy(example(kind))
    if kind.startswith("tenant"):
        broken["spec"]["priority"] = "high"
    else:
        broken["spec"]["engine"]["blockSize"] = 12
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def _broken_pd(role: str, path: str, value) -> dict:
    body = copy.deepcopy(example("inferenceservice-disaggregated"))
    node = body["spec"]["disaggregation"]
    if role:
        node = node[role]
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    if value is _REMOVE:
        del node[leaf]
    else:
        node[leaf] = value
    return body


_REMOVE = object()


@pytest.mark.parametrize(
    ("role", "path", "value"),
    [
        ("decode", "replicas", 0),  # decode engines serve every request
        ("prefill", "replicas", -1),
        ("prefill", "replicas", "2"),
        ("decode", "replicas", _REMOVE),
        ("", "decode", _REMOVE),
        ("prefill", "replica", 2),  # a typo: strict field validation refuses it
        ("", "embed", {"replicas": 1}),
        ("decode", "autoscaling.metric", "queue"),
        ("decode", "autoscaling.min", 0),
        ("prefill", "autoscaling.max", 1001),
        ("prefill", "autoscaling.metric", "kv"),  # prefill has one metric: queued prefill tokens
        ("prefill", "autoscaling.target", 0),
        ("prefill", "resources.gpusPerReplica", 3),
        ("decode", "placement.nodePool", 7),
    ],
)
def test_the_crd_refuses_a_bad_disaggregation(role, path, value):
    schema = spec_schema("inferenceservices")
    with pytest.raises(jsonschema.ValidationError) as refused:
        jsonschema.validate(_broken_pd(role, path, value), schema)
    assert "disaggregation" in refused.value.absolute_path  # refused for that field, not another


def test_the_crd_accepts_a_prefill_pool_of_none():
    body = _broken_pd("prefill", "replicas", 0)
    del body["spec"]["disaggregation"]["prefill"]["autoscaling"]
    jsonschema.validate(body, spec_schema("inferenceservices"))
    assert [(r.min_replicas, r.max_replicas) for r in role_specs(body["spec"])] == [(0, 0), (2, 8)]


@pytest.mark.parametrize("plural", ["inferenceservices", "tenants"])
def test_crd_schemas_never_set_additional_properties_next_to_properties(plural):
    """The API server refuses such a CRD ("additionalProperties and properties are mutual
    exclusive"): unknown fields are pruned, or refused by strict field validation, instead."""

    def walk(node, where: str) -> list[str]:
        if not isinstance(node, dict):
            return []
        found = [where] if "properties" in node and "additionalProperties" in node else []
        for key, value in node.items():
            children = value.items() if key == "properties" else [(key, value)]
            found += [p for name, child in children for p in walk(child, f"{where}.{name}")]
        return found

    assert walk(crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "") == []


def test_tenants_become_the_gateways_tenants_file_without_clear_keys():
    import base64

    from kvharbor.gateway.tenants import parse_tenants
    from kvharbor.operator.tenants import TenantError, gateway_tenant, gateway_tenants_secret

    tenant = example("tenant")
    secret = {"metadata": {"name": "acme-api-key"}, "data": {"api-key": base64.b64encode(b"sk-one\nsk-two\n").decode()}}
    entry = gateway_tenant(tenant, secret)
    manifest = gateway_tenants_secret("kvharbor-tenants", "inference", [entry])
    kubernetes_validate.validate(manifest, "1.37", strict=True)
    text = base64.b64decode(manifest["data"]["tenants.yaml"]).decode()
    assert "sk-one" not in text and "sk-two" not in text
    parsed = parse_tenants(yaml.safe_load(text))  # the gateway accepts it as is
    (acme,) = {t.name: t for t in parsed.values()}.values()
    assert acme.limits.max_concurrent == 32 and acme.models == ("Llama-3.1-8B-Instruct",) and len(acme.api_keys) == 2
    assert (
        gateway_tenants_secret("kvharbor-tenants", "inference", [dict(entry)]) == manifest
    )  # writing twice: same bytes
    with pytest.raises(TenantError, match="no key"):
        gateway_tenant(tenant, {"metadata": {"name": "x"}, "data": {}})


def test_the_engine_accepts_the_config_and_args_the_operator_gives_it(tmp_path):
    """The ConfigMap's engine.yaml and the container's args go through `kvharbor serve`'s own parser."""
    from kvharbor.common.config import config_from_argv
    from kvharbor.engine.config import ServeConfig

    configmap, deployment = objects_for(example("inferenceservice")["spec"])[:2]
    (tmp_path / "engine.yaml").write_text(configmap["data"]["engine.yaml"])
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "serve"
    argv = [str(tmp_path / "engine.yaml") if a == "/etc/kvharbor/engine.yaml" else a for a in args[1:]]
    config = config_from_argv(ServeConfig, argv, "test", "test")
    assert config.server.port == 8000 and config.server.host == "0.0.0.0"
    assert config.server.redis_url == "redis://redis:6379/0"
    assert config.engine.model.quantization == "none"
    spec = example("inferenceservice")["spec"] | {"quantization": "int4", "kvCacheDtype": "int8"}
    (tmp_path / "engine.yaml").write_text(objects_for(spec)[0]["data"]["engine.yaml"])
    config = config_from_argv(ServeConfig, argv, "test", "test")
    assert config.engine.model.quantization == "int4" and config.engine.cache.kv_cache_dtype == "int8"
    assert config.engine.disagg.role == "both" and config.engine.disagg.transfer_port is None


def test_the_engine_of_each_role_serves_that_role_on_the_declared_port(tmp_path):
    from kvharbor.common.config import config_from_argv
    from kvharbor.engine.config import ServeConfig

    objs = by_name(pd_objects(example("inferenceservice-disaggregated")["spec"]))
    for role, transfer_port in (("prefill", 8200), ("decode", None)):
        configmap = objs["ConfigMap", f"qwen-7b-pd-engine-{role}-config"]
        (tmp_path / "engine.yaml").write_text(configmap["data"]["engine.yaml"])
        container = objs["Deployment", f"qwen-7b-pd-engine-{role}"]["spec"]["template"]["spec"]["containers"][0]
        argv = [str(tmp_path / "engine.yaml") if a == "/etc/kvharbor/engine.yaml" else a for a in container["args"][1:]]
        disagg = config_from_argv(ServeConfig, argv, "test", "test").engine.disagg
        assert (disagg.role, disagg.transfer_port) == (role, transfer_port)
        declared = {p["containerPort"] for p in container["ports"]}
        assert transfer_port is None or transfer_port in declared  # a fixed port the pod declares, not ephemeral


@pytest.mark.parametrize("version", VERSIONS)
def test_events_the_operator_posts_are_valid_kubernetes(version):
    from kvharbor.operator.status import Event, event_manifest

    tenant = {"apiVersion": "kvharbor.io/v1alpha1", "kind": "Tenant",
              "metadata": {"name": "acme", "namespace": "inference", "uid": "u-1"}}  # fmt: skip
    kubernetes_validate.validate(event_manifest(tenant, Event("Warning", "Invalid", "x" * 5000)), version, strict=True)


def test_an_embedding_service_runs_engines_with_task_embed_and_refuses_what_it_cannot_run(tmp_path):
    """Issue 48: `task: embed` reaches the engine's config (through `kvharbor serve`'s own parser),
    the CRD schema takes it, and an embedding service asks for no P/D or adapters."""
    from kvharbor.common.config import config_from_argv
    from kvharbor.engine.config import ServeConfig

    base = example("inferenceservice")["spec"]
    spec = base | {"task": "embed"}
    jsonschema.validate({"spec": spec}, spec_schema("inferenceservices"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"spec": base | {"task": "rerank"}}, spec_schema("inferenceservices"))
    configmap, deployment = objects_for(spec)[:2]
    (tmp_path / "engine.yaml").write_text(configmap["data"]["engine.yaml"])
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    argv = [str(tmp_path / "engine.yaml") if a == "/etc/kvharbor/engine.yaml" else a for a in args[1:]]
    assert config_from_argv(ServeConfig, argv, "test", "test").engine.model.task == "embed"
    assert "task" not in yaml.safe_load(objects_for(base)[0]["data"]["engine.yaml"])  # generating: unchanged
    for extra in ({"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}},
                  {"adapters": [{"name": "a", "source": "/a"}]}):  # fmt: skip
        with pytest.raises(ValueError, match="task embed"):
            role_specs(spec | extra)
