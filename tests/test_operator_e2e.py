"""The real operator (`kvharbor operator`, the real kopf in its own process) against the
test-only Kubernetes API double (tests/kube_api_double.py), with a real Redis for the KV index.

No Kubernetes controllers run here: nothing creates pods, EndpointSlices or Deployment status.
Where the operator reads those, the tests write them, and a small HTTP server stands in for the
engine pods' /load (no engine pod can run here).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from kube_api_double import KubeAPIDouble
from servers import OperatorProcess, wait_for
from test_operator_placement import node

from kvharbor.common.kube import Kube
from kvharbor.common.kv_events import BlockStored, EventEnvelope
from kvharbor.kvcache_service.redis_index import RedisIndex
from kvharbor.operator.config import EngineDefaults, OperatorConfig
from kvharbor.operator.model_profiles import KNOWN
from kvharbor.operator.reconcile import OperatorContext, reconcile_service

pytestmark = pytest.mark.slow  # the real kopf operator and redis-server

CRDS = sorted((Path(__file__).resolve().parent.parent / "charts" / "kvharbor" / "crds").glob("*.yaml"))
API = "kvharbor.io/v1alpha1"
NS = "inference"
TENANTS_NS = "kvharbor"


NODES = [
    node("h100-0", "h100", 8, "NVIDIA-H100-80GB-HBM3", 81559),
    node("l4-0", "l4", 4, "NVIDIA-L4", 23034),
    node("cpu-0", "cpu", 0, None, None),
]


def inference_service(name: str, **spec) -> dict:
    body = {
        "model": {"source": "/models/llama", "name": "Llama-3.1-8B-Instruct", "maxModelLen": 8192},
        "replicas": {"min": 1, "max": 3},
        "engine": {"maxNumSeqs": 16},
        "autoscaling": {"metric": "queue", "target": 4},
    }
    body.update(spec)
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": name, "namespace": NS}, "spec": body}


class LoadStandIn:
    """/load answers standing in for engine pods; `load` is what every engine reports, and
    `metrics` (when set) what a vLLM pod's /metrics says."""

    def __init__(self) -> None:
        self.load = {"running": 0, "waiting": 0, "kv_blocks_free": 100, "kv_blocks_total": 100}
        self.metrics: str | None = None
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                metrics = self.path == "/metrics" and stand_in.metrics is not None
                body = stand_in.metrics.encode() if metrics else json.dumps(stand_in.load).encode()
                self.send_response(200 if self.path == "/load" or metrics else 404)
                self.send_header("Content-Type", "text/plain" if metrics else "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_server):
    """The API double with GPU nodes, a /load stand-in, and the operator running against both."""
    tmp = tmp_path_factory.mktemp("operator")
    load = LoadStandIn()
    with KubeAPIDouble(CRDS) as api:
        for n in NODES:
            api.create(n)
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
        args = ["--interval", "1", "--scale-up-cooldown", "0", "--scale-down-cooldown", "3600",
                "--redis-url", redis_server.url, "--tenants-namespace", TENANTS_NS, "--no-log-json"]  # fmt: skip
        operator = OperatorProcess(tmp, kubeconfig, *args)
        try:
            operator.start(timeout=60)
            yield api, operator, load, kubeconfig
        finally:
            operator.stop()
            load.close()


def status_of(api: KubeAPIDouble, name: str) -> dict:
    obj = api.get(API, "InferenceService", name, NS)
    return (obj or {}).get("status") or {}


def condition(api: KubeAPIDouble, name: str, type_: str) -> dict:
    return next((c for c in status_of(api, name).get("conditions", []) if c["type"] == type_), {})


def events_for(api: KubeAPIDouble, name: str) -> list[dict]:
    return [e for e in api.list("v1", "Event", NS) if e.get("involvedObject", {}).get("name") == name]


def wait_for_event(api: KubeAPIDouble, name: str, match, what: str) -> None:
    """kopf posts events in the background, after the patches a test waits for: wait for them too."""
    wait_for(lambda: any(match(e) for e in events_for(api, name)), 10, what)


def test_an_inference_service_is_placed_and_deployed_with_owned_objects(cluster):
    api, _, _, _ = cluster
    svc = api.create(inference_service("llama"))
    wait_for(lambda: condition(api, "llama", "Placed").get("status") == "True", 30, "Placed=True")
    status = status_of(api, "llama")
    # Llama-3.1-8B in bf16: 15 GiB weights + 16 GiB KV (16 x 8192 tokens at 128 KiB) fit two L4s.
    assert status["placement"]["pool"] == "l4" and status["placement"]["gpusPerReplica"] == 2
    assert status["placement"]["bytesPerToken"] == 2 * 32 * 8 * 128 * 2
    assert status["placement"]["weightBytes"] == 8_030_261_248 * 2
    assert status["observedGeneration"] == 1
    uid = svc["metadata"]["uid"]
    owned = {
        "Deployment": api.get("apps/v1", "Deployment", "llama-engine", NS),
        "Service": api.get("v1", "Service", "llama", NS),
        "PodDisruptionBudget": api.get("policy/v1", "PodDisruptionBudget", "llama-engine", NS),
        "ConfigMap": api.get("v1", "ConfigMap", "llama-engine-config", NS),
    }
    for kind, obj in owned.items():
        assert obj is not None, f"no {kind}"
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [uid], kind
    pod = owned["Deployment"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kvharbor.io/pool": "l4"}
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert owned["Deployment"]["spec"]["replicas"] == 1
    for reason in ("Placed", "Created"):
        wait_for_event(api, "llama", lambda e, r=reason: e["reason"] == r, f"the {reason} event")


def test_reconciling_again_writes_nothing(cluster, redis_server):
    api, _, _, _ = cluster
    config = OperatorConfig(engine=EngineDefaults(redis_url=redis_server.url))  # as the operator runs
    wait_for(lambda: api.get("apps/v1", "Deployment", "llama-engine", NS), 30, "the llama Deployment")

    async def reconcile_once() -> None:
        ctx = OperatorContext(config, Kube(httpx.AsyncClient(base_url=api.url)), httpx.AsyncClient())
        try:
            await reconcile_service(ctx, api.get(API, "InferenceService", "llama", NS))
        finally:
            await ctx.close()

    before = len(api.writes)
    asyncio.run(reconcile_once())
    children = ("/deployments/", "/services/", "/poddisruptionbudgets/", "/configmaps/")
    assert [w for w in api.writes[before:] if any(c in w[1] for c in children)] == []


def test_a_spec_change_rolls_the_deployment(cluster):
    api, _, _, _ = cluster
    wait_for(lambda: api.get("apps/v1", "Deployment", "llama-engine", NS), 30, "the llama Deployment")

    def rollout() -> str:
        dep = api.get("apps/v1", "Deployment", "llama-engine", NS)
        return dep["spec"]["template"]["metadata"]["annotations"]["kvharbor.io/rollout-hash"]

    old = rollout()
    svc = api.get(API, "InferenceService", "llama", NS)
    svc["spec"]["engine"]["maxNumSeqs"] = 8
    api.apply(svc)
    wait_for(lambda: rollout() != old, 30, "a new rollout hash")
    config = yaml.safe_load(api.get("v1", "ConfigMap", "llama-engine-config", NS)["data"]["engine.yaml"])
    assert config["max_num_seqs"] == 8
    wait_for(lambda: status_of(api, "llama").get("observedGeneration") == 2, 30, "observedGeneration 2")


def test_a_service_no_pool_fits_is_never_deployed_and_says_why(cluster):
    api, _, _, _ = cluster
    huge = {"source": "/models/huge", "name": "huge", "maxModelLen": 8192,
            "profile": {"parameters": 2_000_000_000_000, "layers": 120, "kvHeads": 8, "headDim": 128}}  # fmt: skip
    api.create(inference_service("huge", model=huge))
    wait_for(lambda: condition(api, "huge", "Placed").get("status") == "False", 30, "Placed=False")
    placed = condition(api, "huge", "Placed")
    assert placed["reason"] == "NoFit" and "pool h100: needs" in placed["message"] and "GiB" in placed["message"]
    assert "pool cpu: no GPUs" in placed["message"]
    assert status_of(api, "huge")["phase"] == "Unplaceable"
    assert api.get("apps/v1", "Deployment", "huge-engine", NS) is None
    wait_for_event(api, "huge", lambda e: e["reason"] == "NoFit" and e["type"] == "Warning", "the NoFit event")


def test_queue_depth_scales_the_deployment_up_and_status_follows(cluster):
    api, _, load, _ = cluster
    api.create(inference_service("scaled", model={"source": "/m", "name": "SmolLM2-135M-Instruct"}))
    wait_for(lambda: api.get("apps/v1", "Deployment", "scaled-engine", NS), 30, "the Deployment")
    api.create({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "scaled-abcde", "namespace": NS, "labels": {"kubernetes.io/service-name": "scaled"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": load.port}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    })  # fmt: skip
    api.patch_status("apps/v1", "Deployment", "scaled-engine", NS, {"readyReplicas": 1, "updatedReplicas": 1})
    wait_for(lambda: condition(api, "scaled", "Ready").get("status") == "True", 30, "Ready=True")
    assert status_of(api, "scaled")["endpoints"] == [f"http://127.0.0.1:{load.port}"]
    load.load = {**load.load, "running": 6, "waiting": 6}  # 12 per replica against a target of 4
    replicas = lambda: api.get("apps/v1", "Deployment", "scaled-engine", NS)["spec"]["replicas"]  # noqa: E731
    wait_for(lambda: replicas() == 3, 30, "3 replicas (the max)")
    assert status_of(api, "scaled")["desiredReplicas"] == 3
    wait_for_event(api, "scaled", lambda e: e["reason"] == "Scaled" and "1 -> 3 replicas: queue 12.00" in e["message"],
                   "the Scaled event")  # fmt: skip


def _endpoint_slice(service: str, name: str, port: int) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": port}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    }  # fmt: skip


def test_a_vllm_service_runs_vllm_pods_scaled_on_their_metrics_and_refuses_disaggregation(cluster):
    """engine.kind vllm: a vLLM server and its kv-bridge per pod; the operator reads the pods'
    load from vLLM's /metrics (its /load is not kvharbor's) and scales on it."""
    api, _, _, _ = cluster
    smol = {"source": "/models/smol", "name": "SmolLM2-135M-Instruct", "maxModelLen": 2048}
    api.create(inference_service("vl", model=smol, engine={"kind": "vllm", "maxNumSeqs": 16}))
    wait_for(lambda: condition(api, "vl", "Placed").get("status") == "True", 30, "Placed=True")
    pod = api.get("apps/v1", "Deployment", "vl-engine", NS)["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vllm", "kv-bridge"]
    assert "bridge.yaml" in api.get("v1", "ConfigMap", "vl-engine-config", NS)["data"]
    assert api.get("v1", "Service", "vl", NS)["metadata"]["labels"]["kvharbor.io/engine-kind"] == "vllm"
    engine = LoadStandIn()
    try:
        fixture = (Path(__file__).parent / "fixtures" / "vllm_metrics_0_32.txt").read_text()
        engine.metrics = fixture.replace(
            'vllm:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0',
            'vllm:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} 12.0',
        )  # 12 queued against a target of 4 a replica
        assert "} 12.0" in engine.metrics
        api.create(_endpoint_slice("vl", "vl-abcde", engine.port))
        api.patch_status("apps/v1", "Deployment", "vl-engine", NS, {"readyReplicas": 1, "updatedReplicas": 1})
        replicas = lambda: api.get("apps/v1", "Deployment", "vl-engine", NS)["spec"]["replicas"]  # noqa: E731
        wait_for(lambda: replicas() == 3, 30, "3 replicas from vLLM's queue")
        # /metrics answered. Waited for: the condition's patch may land after the replicas' (seen once
        # in a full run).
        wait_for(lambda: condition(api, "vl", "Degraded").get("reason") == "Healthy", 30, "Degraded=Healthy")
        svc = api.get(API, "InferenceService", "vl", NS)
        svc["spec"]["disaggregation"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
        api.apply(svc)
        wait_for(lambda: condition(api, "vl", "Placed").get("reason") == "InvalidSpec", 30, "Placed=InvalidSpec")
        assert "disaggregation is a kvharbor-engine feature" in condition(api, "vl", "Placed")["message"]
        assert api.get("apps/v1", "Deployment", "vl-engine-prefill", NS) is None  # nothing deployed for it
    finally:
        engine.close()


def test_disaggregation_runs_a_deployment_per_role_each_scaled_on_its_own_load(cluster):
    api, _, _, _ = cluster
    smol = {"source": "/m", "name": "SmolLM2-135M-Instruct"}
    replicas = lambda role: api.get("apps/v1", "Deployment", f"pd-engine-{role}", NS)["spec"]["replicas"]  # noqa: E731
    # Colocated first: turning disaggregation on replaces its Deployment, which must not keep serving.
    api.create(inference_service("pd", model=smol))
    wait_for(lambda: api.get("apps/v1", "Deployment", "pd-engine", NS), 30, "the colocated Deployment")
    svc = api.get(API, "InferenceService", "pd", NS)
    svc["spec"]["disaggregation"] = {
        "prefill": {"replicas": 1, "autoscaling": {"max": 3, "target": 1000}},  # queued prefill tokens
        "decode": {"replicas": 2, "autoscaling": {"min": 1, "max": 3}},  # KV use, target 0.8
    }
    api.apply(svc)
    wait_for(lambda: api.get("apps/v1", "Deployment", "pd-engine", NS) is None, 30, "the colocated one gone")
    deployments = {r: api.get("apps/v1", "Deployment", f"pd-engine-{r}", NS) for r in ("prefill", "decode")}
    for role, dep in deployments.items():
        assert dep["spec"]["template"]["metadata"]["labels"]["kvharbor.io/role"] == role
        assert api.get("v1", "ConfigMap", f"pd-engine-{role}-config", NS) is not None
    prefill_ports = {p["name"]: p["containerPort"] for p in
                     deployments["prefill"]["spec"]["template"]["spec"]["containers"][0]["ports"]}  # fmt: skip
    assert prefill_ports == {"http": 8000, "admin": 9090, "kv-transfer": 8200}
    assert api.get("v1", "ConfigMap", "pd-engine-config", NS) is None
    assert api.get("v1", "Service", "pd", NS)["spec"]["selector"].keys() == {
        "app.kubernetes.io/instance", "app.kubernetes.io/name"}  # both roles: the gateway finds them all
    # One /load stand-in per role, both behind the engine Service (as the gateway discovers them).
    prefill, decode = LoadStandIn(), LoadStandIn()
    try:
        prefill.load = {"role": "prefill", "waiting_prefill_tokens": 0, "kv_blocks_free": 100, "kv_blocks_total": 100}
        decode.load = {"role": "decode", "running": 4, "kv_blocks_free": 20, "kv_blocks_total": 100}  # at target
        for role, stand_in in (("prefill", prefill), ("decode", decode)):
            api.create(_endpoint_slice("pd", f"pd-{role}", stand_in.port))
            ready = deployments[role]["spec"]["replicas"]
            api.patch_status("apps/v1", "Deployment", f"pd-engine-{role}", NS, {"readyReplicas": ready,
                                                                                "updatedReplicas": ready})  # fmt: skip
        wait_for(lambda: condition(api, "pd", "Ready").get("status") == "True", 30, "Ready=True")
        roles = status_of(api, "pd")["roles"]
        assert (roles["prefill"]["readyReplicas"], roles["decode"]["readyReplicas"]) == (1, 2)
        assert roles["decode"]["placement"]["pool"] == "l4" and "placement" not in status_of(api, "pd")
        # A prefill queue scales the prefill engines only ...
        prefill.load = {**prefill.load, "waiting_prefill_tokens": 3000}
        wait_for(lambda: replicas("prefill") == 3, 30, "3 prefill replicas")
        assert replicas("decode") == 2
        # ... and full KV the decode engines only (the prefill queue is now at its target).
        prefill.load = {**prefill.load, "waiting_prefill_tokens": 1000}
        decode.load = {**decode.load, "kv_blocks_free": 0}
        wait_for(lambda: replicas("decode") == 3, 30, "3 decode replicas")
        assert replicas("prefill") == 3
        wait_for(lambda: status_of(api, "pd")["roles"]["decode"].get("desiredReplicas") == 3, 30, "status")
        assert status_of(api, "pd")["roles"]["prefill"]["desiredReplicas"] == 3
        scaled_events = lambda: sorted(e["message"] for e in events_for(api, "pd") if e["reason"] == "Scaled")  # noqa: E731
        wait_for(lambda: len(scaled_events()) == 2, 10, "a Scaled event per role")
        scaled = scaled_events()
        assert scaled[0].startswith("decode engines: 2 -> 3 replicas: kv 1.00")
        assert scaled[1].startswith("prefill engines: 1 -> 3 replicas: prefill_tokens 3000.00")
    finally:
        prefill.close()
        decode.close()


def test_adapters_are_mounted_configured_placed_and_reported_then_a_bad_one_refused(cluster):
    api, _, _, _ = cluster
    smol = {"source": "/m", "name": "SmolLM2-135M-Instruct"}
    adapters = [{"name": "sql", "source": {"configMap": "sql-adapter"}},
                {"name": "chat", "source": {"pvc": {"claimName": "loras", "subPath": "chat"}}}]  # fmt: skip
    api.create(inference_service("lora", model=smol, adapters=adapters, lora={"maxLoras": 2}))
    wait_for(lambda: condition(api, "lora", "Placed").get("status") == "True", 30, "Placed=True")
    pod = api.get("apps/v1", "Deployment", "lora-engine", NS)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/var/lib/kvharbor/adapters/sql"]["configMap"]["name"] == "sql-adapter"
    assert mounts["/var/lib/kvharbor/adapters/chat"]["persistentVolumeClaim"]["claimName"] == "loras"
    config = yaml.safe_load(api.get("v1", "ConfigMap", "lora-engine-config", NS)["data"]["engine.yaml"])
    assert config["lora"] == ["sql=/var/lib/kvharbor/adapters/sql", "chat=/var/lib/kvharbor/adapters/chat"]
    assert (config["max_loras"], config["max_lora_rank"], config["max_cpu_loras"]) == (2, 16, 8)
    placement = status_of(api, "lora")["placement"]
    assert placement["adapterBytes"] == KNOWN["SmolLM2-135M-Instruct"].lora_bytes(2, 16, 8, "bfloat16")
    engine = LoadStandIn()  # one engine, serving one of the two adapters so far
    try:
        engine.load = {**engine.load, "lora_adapters": {"sql": "sql@ab12"}, "lora_slots": 2}
        api.create(_endpoint_slice("lora", "lora-abcde", engine.port))
        api.patch_status("apps/v1", "Deployment", "lora-engine", NS, {"readyReplicas": 1, "updatedReplicas": 1})
        want = [{"name": "sql", "engines": 1, "configured": True, "identities": ["sql@ab12"]},
                {"name": "chat", "engines": 0, "configured": True}]  # fmt: skip
        wait_for(lambda: status_of(api, "lora").get("adapters") == want, 30, "status.adapters")
        # A second adapter named sql: refused with the field named; the running engines stay.
        svc = api.get(API, "InferenceService", "lora", NS)
        svc["spec"]["adapters"].append({"name": "sql", "source": {"path": "/models/sql"}})
        api.apply(svc)
        wait_for(lambda: condition(api, "lora", "Placed").get("reason") == "InvalidSpec", 30, "Placed=InvalidSpec")
        assert "adapters[2].name 'sql' appears twice" in condition(api, "lora", "Placed")["message"]
        assert api.get("apps/v1", "Deployment", "lora-engine", NS) is not None
    finally:
        engine.close()


def _index_entries(redis_url: str, instances: list[tuple[str, str]]) -> dict[str, int]:
    async def body() -> dict[str, int]:
        index = RedisIndex.from_url(redis_url)
        try:
            hashes = (hashlib.sha256(b"block").digest()[:16],)
            for model, inst in instances:
                await index.renew(model, inst, "lease", 600)
                await index.apply([EventEnvelope(BlockStored(hashes, None, 16), inst, model, "lease", 0)])
            return {i.instance: i.blocks for i in await index.instances()}
        finally:
            await index.close()

    return asyncio.run(body())


def test_deletion_drains_then_clears_the_kv_index_and_the_object_goes(cluster, redis_server):
    api, _, _, _ = cluster
    api.create(inference_service("gone", model={"source": "/m", "name": "SmolLM2-135M-Instruct"}))
    wait_for(lambda: api.get("apps/v1", "Deployment", "gone-engine", NS), 30, "the Deployment")
    ours, other = "gone-engine-7d9f8c6b5-x2k4q", "scaled-engine-5c4b3a2d1-abcde"
    held = _index_entries(redis_server.url, [("SmolLM2-135M-Instruct", ours), ("SmolLM2-135M-Instruct", other)])
    assert held[ours] == 1 and held[other] == 1
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": ours, "namespace": NS,
                        "labels": {"app.kubernetes.io/instance": "gone", "app.kubernetes.io/name": "kvharbor-engine"}},
           "spec": {"containers": [{"name": "engine", "image": "x"}]}}  # fmt: skip
    api.create(pod)
    evicted = {**pod, "metadata": {**pod["metadata"], "name": "gone-engine-7d9f8c6b5-old11"},
               "status": {"phase": "Failed", "reason": "Evicted"}}  # fmt: skip
    api.create(evicted)  # stays until someone deletes it; runs nothing, so nothing waits for it
    api.delete(API, "InferenceService", "gone", NS)
    # The finalizer first scales to zero and waits for the pod to drain: the object stays.
    wait_for(lambda: api.get("apps/v1", "Deployment", "gone-engine", NS)["spec"]["replicas"] == 0, 30, "replicas 0")
    assert api.get(API, "InferenceService", "gone", NS)["metadata"]["deletionTimestamp"]
    time.sleep(2.5)  # a few timer passes (--interval 1): autoscaling must not bring the engines back
    assert api.get("apps/v1", "Deployment", "gone-engine", NS)["spec"]["replicas"] == 0
    api.delete("v1", "Pod", ours, NS)
    wait_for(lambda: api.get(API, "InferenceService", "gone", NS) is None, 30, "the object to go")
    left = _index_entries(redis_server.url, [])
    assert ours not in left and left[other] == 1
    assert api.get("apps/v1", "Deployment", "gone-engine", NS) is None  # owned objects are collected
    wait_for_event(api, "gone", lambda e: e["reason"] == "IndexCleared" and "removed 1" in e["message"], "IndexCleared")


def _secret(name: str, namespace: str, data: dict[str, str]) -> dict:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": encoded}


def _tenant(name: str, secret: str, **spec) -> dict:
    return {"apiVersion": API, "kind": "Tenant", "metadata": {"name": name, "namespace": NS},
            "spec": {"apiKeySecretRef": {"name": secret, "key": "api-key"}, **spec}}  # fmt: skip


def test_tenants_become_the_gateways_tenants_secret(cluster):
    api, _, _, _ = cluster
    api.create(_secret("acme-key", NS, {"api-key": "sk-acme-123"}))
    api.create(_tenant("acme", "acme-key", priority=2, limits={"rpm": 60}, models=["SmolLM2-135M-Instruct"]))
    api.create(_tenant("broken", "missing-key"))

    def gateway_tenants() -> dict:
        secret = api.get("v1", "Secret", "kvharbor-gateway-tenants", TENANTS_NS)
        if not secret:
            return {}
        text = base64.b64decode(secret["data"]["tenants.yaml"]).decode()
        return {t["name"]: t for t in yaml.safe_load(text)["tenants"]}

    wait_for(lambda: "acme" in gateway_tenants(), 30, "acme in the gateway's tenants")
    acme = gateway_tenants()["acme"]
    assert acme["api_keys"] == ["sha256:" + hashlib.sha256(b"sk-acme-123").hexdigest()]
    assert acme["priority"] == 2 and acme["limits"]["rpm"] == 60 and acme["models"] == ["SmolLM2-135M-Instruct"]
    assert "sk-acme-123" not in json.dumps(api.get("v1", "Secret", "kvharbor-gateway-tenants", TENANTS_NS))
    assert "broken" not in gateway_tenants()

    def ready(name: str) -> dict:
        conds = (api.get(API, "Tenant", name, NS).get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "Ready"), {})

    wait_for(lambda: ready("broken").get("status") == "False", 30, "broken tenant Ready=False")
    assert "missing-key not found" in ready("broken")["message"]
    assert ready("acme")["status"] == "True"
    wait_for_event(api, "broken", lambda e: e["type"] == "Warning" and e["reason"] == "Invalid", "the Invalid event")
    # The key Secret appears: the next pass takes the tenant in. Deleting a tenant takes it out.
    api.create(_secret("missing-key", NS, {"api-key": "sk-late"}))
    wait_for(lambda: "broken" in gateway_tenants(), 30, "the late tenant")
    api.delete(API, "Tenant", "acme", NS)
    wait_for(lambda: "acme" not in gateway_tenants(), 30, "acme removed")


def test_an_object_it_does_not_own_is_left_alone_and_reported(cluster):
    api, _, _, _ = cluster
    theirs = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "clash", "namespace": NS},
              "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 80}]}}  # fmt: skip
    api.create(theirs)
    api.create(inference_service("clash", model={"source": "/m", "name": "SmolLM2-135M-Instruct"}))
    wait_for(lambda: condition(api, "clash", "Degraded").get("reason") == "NameConflict", 30, "NameConflict")
    assert "Service clash exists and is not owned" in condition(api, "clash", "Degraded")["message"]
    assert api.get("v1", "Service", "clash", NS)["spec"]["selector"] == {"app": "someone-else"}
    assert api.get("apps/v1", "Deployment", "clash-engine", NS) is not None  # the rest is deployed


def test_a_deleted_owned_object_comes_back(cluster):
    api, _, _, _ = cluster
    wait_for(lambda: api.get("v1", "Service", "llama", NS), 30, "the llama Service")
    api.delete("v1", "Service", "llama", NS)
    wait_for(lambda: api.get("v1", "Service", "llama", NS), 30, "the Service recreated by the timer")
