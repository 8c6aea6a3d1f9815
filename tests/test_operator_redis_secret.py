"""Engine pods and their Redis URL, which may hold a password (issue 20): with the operator's
engine_redis_secret the engines read KVHARBOR_REDIS_URL from that Secret and the URL is in no
ConfigMap, arg or env value; without it the old inline redis_url stays. And the engines' admin
port: /metrics off the Service, scraped from the pods."""

from __future__ import annotations

import asyncio
import json
import os
from unittest import mock

import kubernetes_validate
import pytest
import yaml
from test_operator_manifests import L4, example, pd_objects
from test_operator_placement import node

from kvharbor.common.config import config_from_argv, load_config
from kvharbor.engine.config import ServeConfig
from kvharbor.operator.config import OperatorConfig
from kvharbor.operator.model_profiles import KNOWN
from kvharbor.operator.objects import ENGINE_ADMIN_PORT, ENGINE_PORT, desired_objects
from kvharbor.operator.placement import EngineShape, place
from kvharbor.operator.reconcile import OperatorContext, reconcile_service

URL = "rediss://kvharbor:s3cret-pw@redis.example.com:6380/0"
SECRET = ("kvh-redis", "url")


def objects(spec: dict, **kwargs) -> list[dict]:
    model = spec["model"]
    shape = EngineShape(model.get("dtype", "bfloat16"), model.get("maxModelLen", 4096), spec["engine"]["maxNumSeqs"])
    plan = place(KNOWN[model["name"]], shape, [L4])
    return desired_objects("llama-8b", "inference", "uid-1", spec, plan, 2, "kvharbor/engine:0.1.0", **kwargs)


def engine_config_of(configmap: dict, container: dict, tmp_path, env: dict[str, str]) -> ServeConfig:
    """What `kvharbor serve` runs with: the ConfigMap's file, the container's args, and its env."""
    (tmp_path / "engine.yaml").write_text(configmap["data"]["engine.yaml"])
    argv = [str(tmp_path / "engine.yaml") if a == "/etc/kvharbor/engine.yaml" else a for a in container["args"][1:]]
    with mock.patch.dict(os.environ, env):
        return config_from_argv(ServeConfig, argv, "test", "test")


def secret_env(container: dict, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's env as the kubelet fills it from Secrets (the plain values too)."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"], ref["key"]]
    return env


@pytest.mark.parametrize("kind", ["inferenceservice", "inferenceservice-disaggregated"])
def test_engines_read_the_redis_url_from_the_secret_and_no_configmap_holds_it(kind, tmp_path):
    spec = example(kind)["spec"]
    objs = (objects(spec, redis_url=URL, redis_secret=SECRET) if kind == "inferenceservice"
            else pd_objects(spec, redis_secret=SECRET))  # fmt: skip
    assert "s3cret" not in json.dumps(objs) and "redis.example.com" not in json.dumps(objs)
    configmaps = [o for o in objs if o["kind"] == "ConfigMap"]
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert len(configmaps) == len(deployments) == (1 if kind == "inferenceservice" else 2)
    for configmap, deployment in zip(configmaps, deployments, strict=True):
        assert "redis_url" not in yaml.safe_load(configmap["data"]["engine.yaml"])
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        (ref,) = [e for e in container["env"] if e["name"] == "KVHARBOR_REDIS_URL"]
        assert ref == {"name": "KVHARBOR_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "kvh-redis", "key": "url"}}}
        for version in ("1.30", "1.37"):
            kubernetes_validate.validate(deployment, version, strict=True)
        # The engine takes the URL from the env the Secret fills in.
        config = engine_config_of(configmap, container, tmp_path, secret_env(container, {SECRET: URL}))
        assert config.server.redis_url == URL


def test_without_a_secret_the_redis_url_stays_in_the_engine_config(tmp_path):
    objs = objects(example("inferenceservice")["spec"], redis_url="redis://redis:6379/0")
    configmap, deployment = objs[:2]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert [e["name"] for e in container["env"]] == ["POD_NAME"]
    assert yaml.safe_load(configmap["data"]["engine.yaml"])["redis_url"] == "redis://redis:6379/0"
    assert engine_config_of(configmap, container, tmp_path, {}).server.redis_url == "redis://redis:6379/0"
    assert "redis_url" not in yaml.safe_load(objects(example("inferenceservice")["spec"])[0]["data"]["engine.yaml"])


def test_engines_serve_metrics_on_an_admin_port_that_the_service_leaves_out(tmp_path):
    objs = {(o["kind"]): o for o in objects(example("inferenceservice")["spec"])}
    template = objs["Deployment"]["spec"]["template"]
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": ENGINE_PORT, "admin": ENGINE_ADMIN_PORT}
    assert [p["targetPort"] for p in objs["Service"]["spec"]["ports"]] == ["http"]  # not the admin port
    annotations = template["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"], annotations["prometheus.io/path"]) \
        == ("true", str(ENGINE_ADMIN_PORT), "/metrics")  # fmt: skip
    assert container["readinessProbe"]["httpGet"]["port"] == "http"  # the probes answer on both ports
    server = engine_config_of(objs["ConfigMap"], container, tmp_path, {}).server
    assert (server.port, server.admin_port) == (ENGINE_PORT, ENGINE_ADMIN_PORT)


class RecordingKube:
    """The calls reconcile_service makes, for one GPU node pool and no existing objects."""

    def __init__(self) -> None:
        self.ensured: list[dict] = []

    async def list(self, url: str, selector: str | None = None) -> list[dict]:
        return [node(f"l4-{i}", "l4", 4, "NVIDIA-L4", 23034) for i in range(2)] if "nodes" in url else []

    async def get(self, url: str) -> dict | None:
        return None

    async def ensure(self, obj: dict, owner_uid: str | None = None) -> str:
        self.ensured.append(obj)
        return "created"

    async def delete(self, url: str) -> bool:
        return False


def test_the_operator_gives_its_engines_the_secret_it_is_told_of():
    """The chart's env (KVHARBOR_ENGINE_REDIS_SECRET, _KEY) reaches the engine Deployments that
    reconcile_service writes; the operator's own redis_url (for the KV index) stays out of them."""
    env = {"KVHARBOR_REDIS_URL": URL, "KVHARBOR_ENGINE_REDIS_SECRET": "kvh-redis",
           "KVHARBOR_ENGINE_REDIS_SECRET_KEY": "uri"}  # fmt: skip
    config = load_config(OperatorConfig, env=env)
    assert (config.engine.engine_redis_secret, config.engine.engine_redis_secret_key) == ("kvh-redis", "uri")
    assert load_config(OperatorConfig, env={}).engine.engine_redis_secret is None
    kube = RecordingKube()
    body = {"metadata": {"name": "llama-8b", "namespace": "inference", "uid": "u-1"},
            "spec": example("inferenceservice")["spec"]}  # fmt: skip
    outcome = asyncio.run(reconcile_service(OperatorContext(config, kube, None), body))
    assert next(c for c in outcome.status["conditions"] if c["type"] == "Placed")["status"] == "True"
    assert "s3cret" not in json.dumps(kube.ensured)
    (deployment,) = [o for o in kube.ensured if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert {"name": "KVHARBOR_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "kvh-redis", "key": "uri"}}} \
        in container["env"]  # fmt: skip
