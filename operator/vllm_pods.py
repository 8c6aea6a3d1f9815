"""The pods of an InferenceService with `spec.engine.kind: vllm`: a vLLM server and the kv-bridge
sidecar that files its KV events in kvharbor's KV index (issue 25).

- **vllm** (`spec.engine.vllm.image`, default VLLM_IMAGE, or the operator's `vllm_image`): the
  OpenAI server on ENGINE_PORT with the spec's model, dtype, context, block size, batch size and
  prefix caching; `--gpu-memory-utilization` (vLLM's budget for weights, activations and KV
  together, which placement sizes by: operator/placement.py); tensor parallel over the
  replica's GPUs; `--scheduling-policy priority`; LoRA adapters as `--lora-modules NAME=PATH`
  (the same mounts as a kvharbor engine's); `--enable-prompt-tokens-details`, so responses
  report `cached_tokens` as kvharbor engines do; `--kv-events-config` publishing on KV_EVENTS_PORT
  with replay on KV_REPLAY_PORT, under the topic `kv@<pod IP>@<model>`, so events from two pods
  never pass for one another. vLLM binds those two on every interface (it binds only `tcp://*`
  endpoints, and the bridge must reach them); no container port names them, so the chart's engine
  NetworkPolicy admits no other pod to them. Probes on /health (vLLM has no /ready); the gateway
  and the operator read its load from its /metrics.
- **kv-bridge** (the kvharbor engine image): `kvharbor kv-bridge` on the pod's loopback
  endpoints, as the pod's name (its instance id in the index, what the gateway routes to), with
  the gateway's block size and the engines' Redis (the Secret when the operator has one);
  liveness on its /health. Prometheus scrapes the pod here: the bridge's /metrics serves vLLM's
  after its own, as the pod's scrape annotation can name one port only.

What vLLM pods cannot do is refused with the field that asks for it (`check_vllm_spec`):
prefill/decode disaggregation and mid-stream migration are kvharbor-engine features, and
kvharbor's `--quantization` / `--kv-cache-dtype` modes are not vLLM's (vLLM reads a checkpoint's
quantization from its config).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvharbor.common.model_families import HERMES, VLLM_TOOL_ENV, vllm_tool_args
from kvharbor.operator.adapters import LoraSpec
from kvharbor.operator.pod_env import pod_field, redis_secret_env

ENGINE_KINDS = ("kvharbor", "vllm")
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"  # the version whose KV events and /metrics were read (issue 25)
KV_EVENTS_PORT = 5557
KV_REPLAY_PORT = 5558
BRIDGE_PORT = 8590
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's own default
PRESTOP_PAUSE_S = 5  # operator/objects.py's, for kvharbor engines (it imports this module)


def engine_kind(spec: Mapping[str, Any]) -> str:
    """`spec.engine.kind` (kvharbor when absent); raises ValueError for another value, or for a
    vLLM service asking for what only kvharbor engines do."""
    kind = (spec.get("engine") or {}).get("kind", "kvharbor")
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine.kind {kind!r} is not one of {', '.join(ENGINE_KINDS)}")
    if kind == "vllm":
        check_vllm_spec(spec)
    elif vllm_section(spec):
        raise ValueError("engine.vllm applies to engine.kind vllm only: set engine.kind: vllm, or remove engine.vllm")
    return kind


# vLLM flags the operator sets and the kv-bridge, gateway and probes rely on: extraArgs may not move them.
MANAGED_FLAGS = ("--model", "--served-model-name", "--host", "--port", "--block-size", "--kv-events-config",
                 "--scheduling-policy", "--tensor-parallel-size", "--max-model-len", "--tool-call-parser",
                 "--enable-auto-tool-choice", "--structured-outputs-config", "--reasoning-parser",
                 "--runner", "--convert")  # fmt: skip


def check_vllm_spec(spec: Mapping[str, Any]) -> None:
    metric = (spec.get("autoscaling") or {}).get("metric", "queue")
    if metric not in ("queue", "kv"):
        raise ValueError(
            f"autoscaling.metric {metric!r} needs kvharbor engines' SLO figures, which vLLM's /metrics lacks: "
            "use queue or kv for vLLM pods"
        )
    extra = [str(a).split("=", 1)[0] for a in vllm_section(spec).get("extraArgs") or []]
    managed = sorted(set(extra) & set(MANAGED_FLAGS))
    if managed:
        raise ValueError(
            f"engine.vllm.extraArgs sets {', '.join(managed)}, which the operator sets: use the spec's fields"
        )
    if spec.get("disaggregation") is not None:
        raise ValueError(
            "disaggregation is a kvharbor-engine feature (KV hand-offs between prefill and decode engines): "
            "vLLM pods run colocated; remove spec.disaggregation or set engine.kind: kvharbor"
        )
    if spec.get("quantization", "none") != "none":
        raise ValueError(
            f"quantization {spec['quantization']!r} is a kvharbor engine mode; vLLM reads a checkpoint's "
            "quantization from its config: leave spec.quantization unset"
        )
    if spec.get("kvCacheDtype", "auto") != "auto":
        raise ValueError(f"kvCacheDtype {spec['kvCacheDtype']!r} is a kvharbor engine mode: leave it unset for vLLM")
    utilization = vllm_section(spec).get("gpuMemoryUtilization", DEFAULT_GPU_MEMORY_UTILIZATION)
    if not isinstance(utilization, int | float) or not 0.05 <= utilization <= 1.0:
        raise ValueError(f"engine.vllm.gpuMemoryUtilization must be a share in [0.05, 1], got {utilization!r}")


def vllm_section(spec: Mapping[str, Any]) -> dict[str, Any]:
    return dict((spec.get("engine") or {}).get("vllm") or {})


def gpu_memory_utilization(spec: Mapping[str, Any]) -> float:
    return float(vllm_section(spec).get("gpuMemoryUtilization", DEFAULT_GPU_MEMORY_UTILIZATION))


def kv_events_topic(model: str) -> str:
    """The topic of a pod's KV events; $(POD_IP) is expanded by the kubelet in args."""
    return f"kv@$(POD_IP)@{model}"


def vllm_args(spec: Mapping[str, Any], port: int, gpus: int, lora: LoraSpec) -> list[str]:
    model, engine = spec["model"], spec.get("engine") or {}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
              "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}", "topic": kv_events_topic(model["name"])}  # fmt: skip
    args = [
        "--model", model["source"], "--served-model-name", model["name"], "--host", "0.0.0.0", "--port", str(port),
        "--dtype", model.get("dtype", "bfloat16"), "--max-model-len", str(model.get("maxModelLen", 4096)),
        "--block-size", str(engine.get("blockSize", 16)), "--max-num-seqs", str(engine.get("maxNumSeqs", 64)),
        "--gpu-memory-utilization", str(gpu_memory_utilization(spec)), "--tensor-parallel-size", str(gpus),
        "--enable-prefix-caching" if engine.get("prefixCaching", True) else "--no-enable-prefix-caching",
        "--scheduling-policy", "priority", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events, sort_keys=True),
        *_task_args(spec),
    ]  # fmt: skip
    if lora.adapters:
        args += ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank),
                 "--max-cpu-loras", str(lora.max_cpu_loras),
                 "--lora-modules", *(f"{a.name}={a.folder}" for a in lora.adapters)]  # fmt: skip
    return args + [str(a) for a in vllm_section(spec).get("extraArgs") or []]


def _task_args(spec: Mapping[str, Any]) -> list[str]:
    """An embedding model runs vLLM's pooling runner; a generating one gets the tools' flags
    (vLLM answers 400 to tool_choice auto without a parser: common/model_families.py)."""
    if spec.get("task") == "embed":
        return ["--runner", "pooling", "--convert", "embed"]
    vllm = vllm_section(spec)
    return vllm_tool_args(vllm.get("toolCallParser") or HERMES, vllm.get("reasoningParser"))


def vllm_container(spec: Mapping[str, Any], image: str, port: int, gpus: int, lora: LoraSpec) -> dict[str, Any]:
    health = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "name": "vllm",
        "image": vllm_section(spec).get("image") or image,
        "args": vllm_args(spec, port, gpus, lora),
        "env": [pod_field("POD_IP", "status.podIP"), *({"name": k, "value": v} for k, v in VLLM_TOOL_ENV.items())],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "resources": {
            "limits": {"nvidia.com/gpu": str(gpus)},
            "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": str(gpus)},
        },
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
        "startupProbe": {**health, "periodSeconds": 5, "failureThreshold": 360},  # weights load, graphs compile
        # endpoints drop the pod before SIGTERM, as for kvharbor engines (the gateway re-reads them every few s)
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_PAUSE_S}}},
        "volumeMounts": lora.volume_mounts(),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def bridge_config(spec: Mapping[str, Any], redis_url: str | None, vllm_port: int) -> dict[str, Any]:
    """`kvharbor kv-bridge`'s YAML (the same names as its flags); the instance id and topic come
    from the pod as flags."""
    config = {
        "model": spec["model"]["name"],
        "block_size": (spec.get("engine") or {}).get("blockSize", 16),
        "vllm_events": f"tcp://127.0.0.1:{KV_EVENTS_PORT}",
        "vllm_replay": f"tcp://127.0.0.1:{KV_REPLAY_PORT}",
        "vllm_metrics_url": f"http://127.0.0.1:{vllm_port}/metrics",
        "host": "0.0.0.0",
        "port": BRIDGE_PORT,
    }
    return config | ({"redis_url": redis_url} if redis_url else {})


def bridge_container(spec: Mapping[str, Any], image: str, redis_secret: tuple[str, str] | None) -> dict[str, Any]:
    env = [pod_field("POD_NAME", "metadata.name"), pod_field("POD_IP", "status.podIP"), *redis_secret_env(redis_secret)]
    return {
        "name": "kv-bridge",
        "image": image,
        "args": [
            "kv-bridge",
            "--config",
            "/etc/kvharbor/bridge.yaml",
            "--instance-id",
            "$(POD_NAME)",
            "--vllm-topic",
            kv_events_topic(spec["model"]["name"]),
        ],
        "env": env,
        "ports": [{"name": "bridge", "containerPort": BRIDGE_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "bridge"}, "periodSeconds": 10, "failureThreshold": 3},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/kvharbor", "readOnly": True}],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
