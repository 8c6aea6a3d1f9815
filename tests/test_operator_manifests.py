"""The operator's objects and CRDs are valid Kubernetes (kubernetes-validate, strict, 1.30 and
1.37); the example CRs satisfy our CRDs' own schemas; desired_objects is pure and rolls on change."""

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

CHART = Path(__file__).resolve().parent.parent / "charts" / "kvharbor"
VERSIONS = ("1.30", "1.37")
L4 = Pool("l4", "NVIDIA-L4", 23034 << 20, 4, 3)


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


@pytest.mark.parametrize("version", VERSIONS)
def test_desired_objects_are_valid_kubernetes(version):
    objs = objects_for(example("inferenceservice")["spec"])
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"]
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)
        owner = obj["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "InferenceService",
            "llama-8b",
            "uid-1",
            True,
        )


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


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("plural", ["inferenceservices", "tenants"])
def test_crds_are_valid_kubernetes(plural, version):
    kubernetes_validate.validate(crd(plural), version, strict=True)


def _json_schema(openapi: dict) -> dict:
    """OpenAPI v3 (Kubernetes flavour) to JSON Schema: `nullable` becomes a null type."""
    out = {}
    for key, value in openapi.items():
        if isinstance(value, dict):
            value = {k: _json_schema(v) for k, v in value.items()} if key == "properties" else _json_schema(value)
        out[key] = value
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@pytest.mark.parametrize(("kind", "plural"), [("inferenceservice", "inferenceservices"), ("tenant", "tenants")])
def test_examples_satisfy_our_crds(kind, plural):
    schema = _json_schema(crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    jsonschema.validate(example(kind), schema)
    broken = copy.deepcopy(example(kind))
    if kind == "tenant":
        broken["spec"]["priority"] = "high"
    else:
        broken["spec"]["engine"]["blockSize"] = 12
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


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


@pytest.mark.parametrize("version", VERSIONS)
def test_events_the_operator_posts_are_valid_kubernetes(version):
    from kvharbor.operator.status import Event, event_manifest

    tenant = {"apiVersion": "kvharbor.io/v1alpha1", "kind": "Tenant",
              "metadata": {"name": "acme", "namespace": "inference", "uid": "u-1"}}  # fmt: skip
    kubernetes_validate.validate(event_manifest(tenant, Event("Warning", "Invalid", "x" * 5000)), version, strict=True)
