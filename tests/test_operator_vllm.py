"""spec.engine.kind vllm: the operator's objects for vLLM pods (a vLLM server and its kv-bridge
sidecar) are valid Kubernetes, carry what each container needs, place by vLLM's
--gpu-memory-utilization, refuse what vLLM pods cannot run, and are found by the gateway's
Kubernetes discovery as vLLM servers named by pod."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml
from test_operator_manifests import H100, L4, VERSIONS, by_name, example

from kvharbor.common.endpoint_slices import ENGINE_KIND_LABEL
from kvharbor.gateway.discovery import engines_from_slices
from kvharbor.gateway.engines import parse_engine
from kvharbor.operator.model_profiles import KNOWN
from kvharbor.operator.objects import desired_objects
from kvharbor.operator.placement import EngineShape, place
from kvharbor.operator.roles import role_specs

SPEC = example("inferenceservice-vllm")["spec"]


def shape(spec: dict, utilization: float | None = 0.9) -> EngineShape:
    model = spec["model"]
    return EngineShape(model["dtype"], model["maxModelLen"], spec["engine"]["maxNumSeqs"],
                       gpu_memory_utilization=utilization)  # fmt: skip


def vllm_objects(spec: dict = SPEC, **kwargs) -> dict[tuple[str, str], dict]:
    plan = place(KNOWN[spec["model"]["name"]], shape(spec), [L4, H100])
    objs = desired_objects("qwen-vllm", "inference", "uid-1", spec, plan, 2, "kvharbor/engine:0.1.0",
                           "redis://redis:6379/0", **kwargs)  # fmt: skip
    return by_name(objs)


@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_objects_are_valid_kubernetes(version):
    for obj in vllm_objects().values():
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_vllm_container_runs_the_spec_with_kv_events_per_pod():
    pod = vllm_objects()["Deployment", "qwen-vllm-engine"]["spec"]["template"]
    vllm, bridge = pod["spec"]["containers"]
    assert (vllm["name"], bridge["name"]) == ("vllm", "kv-bridge")
    assert vllm["image"] == "vllm/vllm-openai:v0.32.0" and bridge["image"] == "kvharbor/engine:0.1.0"
    args = vllm["args"]
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert flag["--model"] == "/models/Qwen2.5-7B-Instruct" and flag["--served-model-name"] == "Qwen2.5-7B-Instruct"
    assert (flag["--block-size"], flag["--max-num-seqs"], flag["--max-model-len"]) == ("16", "64", "8192")
    assert flag["--gpu-memory-utilization"] == "0.9" and flag["--scheduling-policy"] == "priority"
    assert flag["--tensor-parallel-size"] == pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    events = json.loads(flag["--kv-events-config"])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "kv@$(POD_IP)@Qwen2.5-7B-Instruct"}  # fmt: skip
    assert "--enable-prefix-caching" in args and args[-1] == "--enable-chunked-prefill"  # extraArgs last
    assert "--enable-prompt-tokens-details" in args  # cached_tokens in usage, as kvharbor engines report
    # tools with tool_choice auto (issue 47): vLLM answers 400 without a parser
    assert "--enable-auto-tool-choice" in args and flag["--tool-call-parser"] == "hermes"
    own = {**SPEC, "engine": {**SPEC["engine"], "vllm": {**SPEC["engine"]["vllm"], "toolCallParser": "llama3_json"}}}
    own_args = vllm_objects(own)["Deployment", "qwen-vllm-engine"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert own_args[own_args.index("--tool-call-parser") + 1] == "llama3_json"
    assert args[args.index("--lora-modules") + 1] == "sql=/models/adapters/sql" and "--enable-lora" in args
    assert {e["name"] for e in vllm["env"]} == {"POD_IP", "VLLM_ENFORCE_STRICT_TOOL_CALLING"}  # $(POD_IP) in args
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert vllm[probe]["httpGet"]["path"] == "/health"  # vLLM has no /ready
    assert vllm["lifecycle"]["preStop"]["sleep"]["seconds"] > 0  # endpoints drop it before its SIGTERM
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8590"  # the bridge's, carrying vLLM's
    deployment = vllm_objects()["Deployment", "qwen-vllm-engine"]
    assert pod["metadata"]["labels"][ENGINE_KIND_LABEL] == "vllm"  # the chart's scrape policy selects it
    assert ENGINE_KIND_LABEL not in deployment["spec"]["selector"]["matchLabels"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in vllm["volumeMounts"]


def test_the_bridge_sidecar_takes_its_config_and_args_through_its_own_parser(tmp_path):
    from kvharbor.common.config import config_from_argv
    from kvharbor.kv_bridge.config import KVBridgeConfig

    objs = vllm_objects(redis_secret=("engine-redis", "url"))
    configmap = objs["ConfigMap", "qwen-vllm-engine-config"]
    bridge = objs["Deployment", "qwen-vllm-engine"]["spec"]["template"]["spec"]["containers"][1]
    (tmp_path / "bridge.yaml").write_text(configmap["data"]["bridge.yaml"])
    assert "redis_url" not in yaml.safe_load(configmap["data"]["bridge.yaml"])  # the URL stays in its Secret
    env = {e["name"]: e for e in bridge["env"]}
    assert env["KVHARBOR_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "engine-redis", "key": "url"}
    assert bridge["args"][0] == "kv-bridge"
    argv = [str(tmp_path / "bridge.yaml") if a == "/etc/kvharbor/bridge.yaml" else a for a in bridge["args"][1:]]
    argv = [a.replace("$(POD_NAME)", "qwen-vllm-engine-7d9f-abcde").replace("$(POD_IP)", "10.0.0.5") for a in argv]
    config = config_from_argv(KVBridgeConfig, [*argv, "--redis-url", "redis://redis:6379/0"], "test", "test")
    opts = config.bridge
    assert (opts.model, opts.instance_id, opts.block_size) == ("Qwen2.5-7B-Instruct", "qwen-vllm-engine-7d9f-abcde", 16)
    assert opts.vllm_events == "tcp://127.0.0.1:5557" and opts.vllm_topic == "kv@10.0.0.5@Qwen2.5-7B-Instruct"
    assert bridge["livenessProbe"]["httpGet"] == {"path": "/health", "port": "bridge"}
    assert opts.vllm_metrics_url == "http://127.0.0.1:8000/metrics"  # what its /metrics carries after its own
    assert {"name": "bridge", "containerPort": 8590, "protocol": "TCP"} in bridge["ports"]  # the scrape annotation's


def test_the_service_tells_discovery_its_pods_are_vllm_servers():
    service = vllm_objects()["Service", "qwen-vllm"]
    assert service["metadata"]["labels"][ENGINE_KIND_LABEL] == "vllm"
    endpoint_slice = {
        "metadata": {"namespace": "inference", "labels": {"kubernetes.io/service-name": "qwen-vllm"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8000}],
        "endpoints": [
            {"addresses": ["10.0.0.5"], "conditions": {"ready": True}, "targetRef": {"kind": "Pod", "name": "pod-a"}},
            {"addresses": ["10.0.0.6"], "conditions": {"ready": True}},  # no pod: no instance id
        ],
    }  # fmt: skip
    found = engines_from_slices([service], [endpoint_slice])
    assert found == {"Qwen2.5-7B-Instruct": ["vllm+http://10.0.0.5:8000#pod-a"]}
    assert parse_engine(found["Qwen2.5-7B-Instruct"][0]) == ("http://10.0.0.5:8000", "vllm", "pod-a")
    kvharbor = {**service, "metadata": {**service["metadata"], "labels": {
        k: v for k, v in service["metadata"]["labels"].items() if k != ENGINE_KIND_LABEL}}}  # fmt: skip
    assert engines_from_slices([kvharbor], [endpoint_slice]) == {
        "Qwen2.5-7B-Instruct": ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    }


def test_placement_follows_vllms_gpu_memory_utilization():
    """Qwen2.5-7B with 64 x 8192 tokens of KV (28 GiB) and 15 GiB of weights: vLLM at 0.9 of an
    H100 has room; at 0.5 (40 GiB less 1 GiB of activations) it does not, on one GPU."""
    profile = KNOWN["Qwen2.5-7B-Instruct"]
    roomy = place(profile, shape(SPEC, 0.9), [H100], gpus_per_replica=1)
    assert roomy.gpus_per_replica == 1
    tight = place(profile, shape(SPEC, 0.5), [H100], gpus_per_replica=1)
    assert isinstance(tight, list) and "needs" in tight[0]
    # the KV it gets is all of the share weights and activations leave, not kvMemoryFraction of it
    room = int(H100.gpu_memory_bytes * 0.9) - (1 << 30)
    assert roomy.kv_capacity_tokens == (room - roomy.weight_bytes) // roomy.bytes_per_token


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}, "disaggregation is a kvh"),
        ({"quantization": "int4"}, "quantization 'int4' is a kvharbor engine mode"),
        ({"kvCacheDtype": "int8"}, "kvCacheDtype 'int8' is a kvharbor engine mode"),
        ({"engine": {**SPEC["engine"], "vllm": {"gpuMemoryUtilization": 1.5}}}, "gpuMemoryUtilization must be a share"),
        ({"engine": {**SPEC["engine"], "kind": "sglang"}}, "engine.kind 'sglang' is not one of kvharbor, vllm"),
        ({"autoscaling": {"metric": "slo"}}, "needs kvharbor engines' SLO figures"),
        ({"engine": {**SPEC["engine"], "vllm": {"extraArgs": ["--block-size=64"]}}}, "sets --block-size"),
        ({"engine": {**SPEC["engine"], "kind": "kvharbor"}}, "engine.vllm applies to engine.kind vllm only"),
    ],
)  # fmt: skip
def test_what_vllm_pods_cannot_run_is_refused_by_field(change, match):
    with pytest.raises(ValueError, match=match):
        role_specs({**SPEC, **change})


def test_a_kvharbor_service_is_unchanged_by_the_engine_kind():
    """Existing manifests: no kind means kvharbor, and their objects carry no engine-kind label."""
    spec = example("inferenceservice")["spec"]
    explicit = {**spec, "engine": {**spec["engine"], "kind": "kvharbor"}}
    plan = place(KNOWN[spec["model"]["name"]], EngineShape("bfloat16", 8192, 32), [L4])
    objs = [desired_objects("x", "ns", "uid", s, plan, 1, "img", None) for s in (spec, explicit)]
    assert objs[0] == objs[1] and ENGINE_KIND_LABEL not in objs[0][2]["metadata"]["labels"]


def test_a_vllm_embedding_service_runs_the_pooling_runner_without_tool_flags():
    spec = {k: v for k, v in SPEC.items() if k != "adapters"} | {"task": "embed"}
    args = vllm_objects(spec)["Deployment", "qwen-vllm-engine"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--runner") + 1] == "pooling" and args[args.index("--convert") + 1] == "embed"
    assert "--enable-auto-tool-choice" not in args and "--tool-call-parser" not in args
    reasoning = {**SPEC, "engine": {**SPEC["engine"], "vllm": {**SPEC["engine"]["vllm"], "reasoningParser": "qwen3"}}}
    own = vllm_objects(reasoning)["Deployment", "qwen-vllm-engine"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert own[own.index("--reasoning-parser") + 1] == "qwen3"
