"""desired_objects: what an InferenceService becomes in the cluster (DESIGN §6), as plain dicts.

A ConfigMap with the engine config, an engine Deployment (GPU limits, node pool selector,
tolerations, readiness on /ready and liveness on /health, a preStop pause so endpoints drop the
pod before SIGTERM starts the engine's drain, and a grace period longer than the drain), a
Service labelled for the gateway's discovery, and a PodDisruptionBudget, all owned by the
InferenceService. The function is pure: the same spec gives the same objects (reconciling twice
changes nothing), and the pod template carries a hash of what it depends on, so a spec change
rolls the Deployment.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import yaml

from kvharbor.common.endpoint_slices import DISCOVERY_LABEL, MODEL_ANNOTATION, MODEL_LABEL
from kvharbor.operator.placement import POOL_LABEL, PlacementPlan

GROUP_VERSION = "kvharbor.io/v1alpha1"
ENGINE_PORT = 8000
PRESTOP_PAUSE_S = 5


def _label_value(text: str) -> str:
    """A valid label value (63 chars of [A-Za-z0-9._-], alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._")
    return value or "none"


def owner_reference(name: str, uid: str) -> dict:
    return {"apiVersion": GROUP_VERSION, "kind": "InferenceService", "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}  # fmt: skip


def object_names(name: str) -> dict[str, tuple[str, str]]:
    """kind -> (apiVersion, name) of every object an InferenceService owns."""
    return {
        "ConfigMap": ("v1", f"{name}-engine-config"),
        "Deployment": ("apps/v1", f"{name}-engine"),
        "Service": ("v1", name),
        "PodDisruptionBudget": ("policy/v1", f"{name}-engine"),
    }


def engine_selector(name: str) -> dict[str, str]:
    """The labels that select an InferenceService's engine pods."""
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/name": "kvharbor-engine"}


def engine_config(spec: dict, redis_url: str | None) -> dict:
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
        "device": "cuda",
    }
    if redis_url:
        config["redis_url"] = redis_url
    return config


def desired_objects(
    name: str,
    namespace: str,
    uid: str,
    spec: dict,
    placement: PlacementPlan,
    replicas: int,
    image: str,
    redis_url: str | None = None,
    pool_label: str = POOL_LABEL,
) -> list[dict[str, Any]]:
    owner = [owner_reference(name, uid)]
    labels = {"app.kubernetes.io/name": "kvharbor-engine", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/managed-by": "kvharbor-operator"}  # fmt: skip
    selector = engine_selector(name)
    names = object_names(name)
    config = engine_config(spec, redis_url)
    config_yaml = yaml.safe_dump(config, sort_keys=True)
    rollout = hashlib.sha256(
        json.dumps([config_yaml, placement.__dict__, spec.get("placement", {})], sort_keys=True).encode()
    ).hexdigest()[:16]
    drain = int(config["drain_timeout"])
    meta = {"namespace": namespace, "labels": labels, "ownerReferences": owner}
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": names["ConfigMap"][1], **meta},
        "data": {"engine.yaml": config_yaml},
    }
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                   *spec.get("placement", {}).get("tolerations", [])]  # fmt: skip
    container = {
        "name": "engine",
        "image": image,
        "args": ["serve", "--config", "/etc/kvharbor/engine.yaml", "--instance-id", "$(POD_NAME)"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
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
        "volumeMounts": [{"name": "config", "mountPath": "/etc/kvharbor", "readOnly": True}],
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names["Deployment"][1], **meta},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels, "annotations": {"kvharbor.io/rollout-hash": rollout}},
                "spec": {
                    "nodeSelector": {pool_label: placement.pool},
                    "tolerations": tolerations,
                    "terminationGracePeriodSeconds": drain + PRESTOP_PAUSE_S + 15,
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": configmap["metadata"]["name"]}}],
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": names["Service"][1],
            **meta,
            "labels": {**labels, DISCOVERY_LABEL: "engine", MODEL_LABEL: _label_value(spec["model"]["name"])},
            "annotations": {MODEL_ANNOTATION: spec["model"]["name"]},
        },
        "spec": {"selector": selector, "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}]},
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": names["PodDisruptionBudget"][1], **meta},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
    }
    return [configmap, deployment, service, pdb]
