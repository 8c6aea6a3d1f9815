"""desired_objects: what an InferenceService becomes in the cluster, as plain dicts.

Per engine role (operator/roles.py: one colocated `both`, or `prefill` and `decode`) a ConfigMap
with the engine config, an engine Deployment (GPU limits, node pool selector, tolerations,
readiness on /ready and liveness on /health, a preStop pause so endpoints drop the pod before
SIGTERM starts the engine's drain, and a grace period longer than the drain) and a
PodDisruptionBudget; then one Service labelled for the gateway's discovery, which selects the
engines of every role (the gateway tells them apart by their /load role). All are owned by the
InferenceService. The function is pure: the same spec gives the same objects (reconciling twice
changes nothing), and each pod template carries a hash of what it depends on, so a spec change
rolls the Deployment.

    kind         colocated              disaggregated (role: prefill, decode)
    ConfigMap    <name>-engine-config   <name>-engine-<role>-config
    Deployment   <name>-engine          <name>-engine-<role>   (label and selector kvharbor.io/role)
    PDB          <name>-engine          <name>-engine-<role>
    Service      <name>                 <name>, over both roles

A colocated service's objects carry no role label: in its pod template one would roll every
engine on upgrade, and a Deployment's selector cannot change. Its Service says
`kvharbor.io/roles: both`, a disaggregated one's `prefill-decode`.

LoRA adapters (`spec.adapters`, operator/adapters.py) go to every role alike: the engine config's
`lora` list and limits, and read-only mounts of the ConfigMaps and PVCs they come from.

With `spec.engine.kind: vllm` (operator/vllm_pods.py) the same objects hold a vLLM server and its
kv-bridge sidecar instead: the ConfigMap holds the bridge's config (bridge.yaml), the pod a
`vllm` and a `kv-bridge` container and a memory-backed /dev/shm, and the Service says
`kvharbor.io/engine-kind: vllm`, so the gateway reaches its pods as vLLM servers named by pod.

Every engine serves /metrics (and the runtime adapter calls) on its admin port, ENGINE_ADMIN_PORT,
a container port named `admin` that the Service leaves out; the pods carry prometheus.io scrape
annotations for it. With `redis_secret` (NAME, KEY) the Redis URL, which may hold a password, stays
out of the ConfigMap: the engine reads KVHARBOR_REDIS_URL from that Secret of its namespace.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from kvharbor.common.endpoint_slices import DISCOVERY_LABEL, ENGINE_KIND_LABEL, MODEL_ANNOTATION, MODEL_LABEL
from kvharbor.operator import vllm_pods
from kvharbor.operator.adapters import LoraSpec, lora_spec
from kvharbor.operator.placement import POOL_LABEL, PlacementPlan
from kvharbor.operator.pod_env import pod_field, redis_secret_env
from kvharbor.operator.roles import COLOCATED, RoleSpec, role_specs

GROUP_VERSION = "kvharbor.io/v1alpha1"
ENGINE_PORT = 8000
ENGINE_ADMIN_PORT = 9090  # /metrics and operator-facing endpoints (--admin-port); not in the Service
KV_TRANSFER_PORT = 8200  # prefill engines serve KV hand-offs here; decode engines dial the pod IP
PRESTOP_PAUSE_S = vllm_pods.PRESTOP_PAUSE_S  # seconds endpoints take to drop a pod before its SIGTERM
ROLE_LABEL = "kvharbor.io/role"  # on a role's pods, Deployment, ConfigMap and PDB
ROLES_LABEL = "kvharbor.io/roles"  # on the Service: both, or prefill-decode
# on the engine pods: where Prometheus scrapes them (the admin port)
SCRAPE = {"prometheus.io/scrape": "true", "prometheus.io/port": str(ENGINE_ADMIN_PORT),
          "prometheus.io/path": "/metrics"}  # fmt: skip


def _label_value(text: str) -> str:
    """A valid label value (63 chars of [A-Za-z0-9._-], alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._")
    return value or "none"


def owner_reference(name: str, uid: str) -> dict:
    return {"apiVersion": GROUP_VERSION, "kind": "InferenceService", "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def deployment_name(name: str, role: str = COLOCATED) -> str:
    # NOTE: "-engine" stays next to the service name, so no other InferenceService's names can
    # collide with a role's: theirs end in "-engine", a role's in "-prefill" / "-decode".
    return f"{name}-engine" if role == COLOCATED else f"{name}-engine-{role}"


def object_names(name: str, role: str = COLOCATED) -> dict[str, tuple[str, str]]:
    """kind -> (apiVersion, name) of the objects an InferenceService owns for one engine role
    (the Service is the same for every role)."""
    engine = deployment_name(name, role)
    return {
        "ConfigMap": ("v1", f"{engine}-config"),
        "Deployment": ("apps/v1", engine),
        "Service": ("v1", name),
        "PodDisruptionBudget": ("policy/v1", engine),
    }


def engine_selector(name: str, role: str | None = None) -> dict[str, str]:
    """The labels that select an InferenceService's engine pods: every role's, or one role's."""
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/name": "kvharbor-engine"}
    return selector if role in (None, COLOCATED) else {**selector, ROLE_LABEL: role}


def engine_config(spec: dict, redis_url: str | None, role: str = COLOCATED) -> dict:
    """The engine's YAML config (the same names as `kvharbor serve` flags)."""
    model, engine, slo = spec["model"], spec.get("engine", {}), spec.get("slo", {})
    config = {
        "model": model["source"],
        "served_model_name": model["name"],
        "dtype": model.get("dtype", "bfloat16"),
        "quantization": spec.get("quantization", "none"),
        "kv_cache_dtype": spec.get("kvCacheDtype", "auto"),
        "max_model_len": model.get("maxModelLen", 4096),
        "block_size": engine.get("blockSize", 16),
        "max_num_seqs": engine.get("maxNumSeqs", 64),
        "enable_prefix_caching": engine.get("prefixCaching", True),
        "kv_memory_fraction": engine.get("kvMemoryFraction", 0.9),
        "drain_timeout": engine.get("drainTimeoutSeconds", 30),
        "slo_ttft_ms": slo.get("ttftP95Ms", 2000),
        "slo_itl_ms": slo.get("itlP95Ms", 200),
        "host": "0.0.0.0",
        "port": ENGINE_PORT,
        "admin_port": ENGINE_ADMIN_PORT,
        "device": "cuda",
    }
    if redis_url:
        config["redis_url"] = redis_url
    if spec.get("task") == "embed":  # only then: a generating engine's config stays as it was (no rollout)
        config["task"] = "embed"
    if role != COLOCATED:  # a colocated engine's config stays as it was: no rollout on upgrade
        config["role"] = role
    if role == "prefill":
        config["kv_transfer_port"] = KV_TRANSFER_PORT  # fixed: a pod declares its ports
    config.update(lora_spec(spec).engine_config())  # nothing without adapters
    return config


def desired_objects(
    name: str,
    namespace: str,
    uid: str,
    spec: dict,
    placement: PlacementPlan | Mapping[str, PlacementPlan],
    replicas: int | Mapping[str, int],
    image: str,
    redis_url: str | None = None,
    pool_label: str = POOL_LABEL,
    redis_secret: tuple[str, str] | None = None,
    vllm_image: str = vllm_pods.VLLM_IMAGE,
) -> list[dict[str, Any]]:
    """Every object of the roles `spec` runs (operator/roles.py): per role a ConfigMap and a
    Deployment, then the Service, then per role a PodDisruptionBudget. `placement` and
    `replicas` map each role to its own, or are one value for every role. The engines' Redis is
    `redis_secret` (Secret name, key: env KVHARBOR_REDIS_URL from it) when given, else `redis_url`
    written into their ConfigMap. `image` runs kvharbor engines (and vLLM pods' kv-bridge),
    `vllm_image` vLLM servers unless the spec names its own."""
    owner = [owner_reference(name, uid)]
    roles = role_specs(spec)
    per_role = [
        role_objects(name, namespace, owner, spec, role, _of(placement, role.role), _of(replicas, role.role),
                     image, None if redis_secret else redis_url, pool_label, redis_secret, vllm_image)
        for role in roles
    ]  # fmt: skip
    service = engine_service(name, namespace, owner, spec, [role.role for role in roles])
    return [*(o for objs in per_role for o in objs[:2]), service, *(objs[2] for objs in per_role)]


def _of(value: Any, role: str) -> Any:
    return value[role] if isinstance(value, Mapping) else value


def engine_labels(name: str, role: str) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "kvharbor-engine", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/managed-by": "kvharbor-operator"}  # fmt: skip
    return labels if role == COLOCATED else {**labels, ROLE_LABEL: role}


def role_objects(
    name: str,
    namespace: str,
    owner: list[dict],
    spec: dict,
    role: RoleSpec,
    placement: PlacementPlan,
    replicas: int,
    image: str,
    redis_url: str | None,
    pool_label: str,
    redis_secret: tuple[str, str] | None = None,
    vllm_image: str = vllm_pods.VLLM_IMAGE,
) -> list[dict[str, Any]]:
    """[ConfigMap, Deployment, PodDisruptionBudget] of one engine role."""
    labels = engine_labels(name, role.role)
    selector = engine_selector(name, role.role)
    names = object_names(name, role.role)
    lora = lora_spec(spec)
    vllm = vllm_pods.engine_kind(spec) == "vllm"
    if vllm:
        config, config_file = vllm_pods.bridge_config(spec, redis_url, ENGINE_PORT), "bridge.yaml"
        containers = [
            vllm_pods.vllm_container(spec, vllm_image, ENGINE_PORT, placement.gpus_per_replica, lora),
            vllm_pods.bridge_container(spec, image, redis_secret),
        ]
    else:
        config, config_file = engine_config(spec, redis_url, role.role), "engine.yaml"
        containers = [engine_container(image, placement, role.role, lora, redis_secret)]
    config_yaml = yaml.safe_dump(config, sort_keys=True)
    # NOTE: adapter_bytes stays out of the hash: adapters change the engine config already, and a
    # plan field that came with issue 18 must not roll every engine when the operator is upgraded.
    plan = {k: v for k, v in placement.__dict__.items() if k != "adapter_bytes"}
    rollout = hashlib.sha256(json.dumps([config_yaml, plan, role.placement], sort_keys=True).encode()).hexdigest()[:16]
    drain = int((spec.get("engine") or {}).get("drainTimeoutSeconds", 30))
    meta = {"namespace": namespace, "labels": labels, "ownerReferences": owner}
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": names["ConfigMap"][1], **meta},
        "data": {config_file: config_yaml},
    }
    volumes = [{"name": "config", "configMap": {"name": configmap["metadata"]["name"]}}, *lora.volumes()]
    # vLLM pods: tensor parallel workers share memory through /dev/shm (64 MiB by default); the
    # image runs as root, so only the bridge sidecar is made non-root.
    if vllm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}})
        containers[0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    pod_security = {"fsGroup": 10001} if vllm else {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001}
    # A vLLM pod is scraped at its kv-bridge, whose /metrics carries vLLM's after its own (one port
    # per pod in the annotations). The pods say so (not in the selector): the chart lets metrics
    # scrapers reach that port.
    scrape = {**SCRAPE, "prometheus.io/port": str(vllm_pods.BRIDGE_PORT)} if vllm else SCRAPE
    pod_labels = {**labels, ENGINE_KIND_LABEL: "vllm"} if vllm else labels
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                   *role.placement.get("tolerations", [])]  # fmt: skip
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names["Deployment"][1], **meta},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": {"kvharbor.io/rollout-hash": rollout, **scrape}},
                "spec": {
                    "nodeSelector": {pool_label: placement.pool},
                    "tolerations": tolerations,
                    "terminationGracePeriodSeconds": drain + PRESTOP_PAUSE_S + 15,
                    "containers": containers,
                    "volumes": volumes,
                    "securityContext": pod_security,
                },
            },
        },
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": names["PodDisruptionBudget"][1], **meta},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }
    return [configmap, deployment, pdb]


def engine_container(
    image: str, placement: PlacementPlan, role: str, lora: LoraSpec | None = None,
    redis_secret: tuple[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    ports = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
             {"name": "admin", "containerPort": ENGINE_ADMIN_PORT, "protocol": "TCP"}]  # fmt: skip
    if role == "prefill":
        ports.append({"name": "kv-transfer", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"})
    env = [pod_field("POD_NAME", "metadata.name"), *redis_secret_env(redis_secret)]
    return {
        "name": "engine",
        "image": image,
        "args": ["serve", "--config", "/etc/kvharbor/engine.yaml", "--instance-id", "$(POD_NAME)"],
        "env": env,
        "ports": ports,
        "resources": {
            "limits": {"nvidia.com/gpu": str(placement.gpus_per_replica)},
            "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": str(placement.gpus_per_replica)},
        },
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "initialDelaySeconds": 30,
        },
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 120},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_PAUSE_S}}},
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/kvharbor", "readOnly": True},
            *(lora.volume_mounts() if lora else []),
        ],
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def engine_service(name: str, namespace: str, owner: list[dict], spec: dict, roles: Sequence[str]) -> dict[str, Any]:
    """The one engine Service: it selects every role's engines, so the gateway's discovery finds
    the prefill pool and the decode engines alike (gateway/discovery.py) and reads each one's role in /load."""
    labels = {**engine_labels(name, COLOCATED), DISCOVERY_LABEL: "engine",
              MODEL_LABEL: _label_value(spec["model"]["name"]), ROLES_LABEL: "-".join(roles)}  # fmt: skip
    if vllm_pods.engine_kind(spec) == "vllm":  # absent for kvharbor engines: their Services stay as they were
        labels[ENGINE_KIND_LABEL] = "vllm"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": object_names(name)["Service"][1],
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": owner,
            "annotations": {MODEL_ANNOTATION: spec["model"]["name"]},
        },
        "spec": {
            "selector": engine_selector(name),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}],
        },
    }
