"""Engine discovery in Kubernetes, the contract between the operator and the gateway: the labels
and annotation the operator puts on each engine Service, and engine URLs from the Service's
EndpointSlices (discovery.k8s.io/v1), which the gateway routes to and the operator polls for
load. Only endpoints whose `ready` condition is not false count, as kube-proxy does, so a
draining pod (terminating, not ready) gets no new requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set on every slice by the EndpointSlice controller
DISCOVERY_LABEL = "kvharbor.io/discovery"  # = "engine" on every engine Service
MODEL_LABEL = "kvharbor.io/model"  # the served model name made a label value (for selectors)
MODEL_ANNOTATION = "kvharbor.io/model-name"  # the exact served model name (labels cannot hold "/")
# = "vllm" on a Service of vLLM pods (absent: kvharbor engines): the gateway reads their load from
# /metrics and names each by its pod (the instance id its kv-bridge publishes under).
ENGINE_KIND_LABEL = "kvharbor.io/engine-kind"


def service_model(service: Mapping[str, Any]) -> str | None:
    """The served model of an engine Service; None for any other Service."""
    meta = service.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(DISCOVERY_LABEL) != "engine":
        return None
    return (meta.get("annotations") or {}).get(MODEL_ANNOTATION) or labels.get(MODEL_LABEL)


def service_engine_kind(service: Mapping[str, Any]) -> str:
    """kvharbor or vllm: what the engines behind an engine Service are."""
    return ((service.get("metadata") or {}).get("labels") or {}).get(ENGINE_KIND_LABEL, "kvharbor")


def slice_urls(endpoint_slice: Mapping[str, Any], port_name: str = "http", kind: str = "kvharbor") -> list[str]:
    """The ready endpoints of one slice as http://ADDRESS:PORT (IPv6 addresses in brackets); for
    vLLM pods as vllm+http://ADDRESS:PORT#POD (the gateway's engine address, gateway/engines.py).
    A vLLM endpoint without a pod reference has no instance id to route by, and is left out."""
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") in (port_name, None)), None)
    if port is None:
        return []
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        pod = (endpoint.get("targetRef") or {}).get("name")
        if kind == "vllm" and not pod:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.append(f"vllm+http://{host}:{port}#{pod}" if kind == "vllm" else f"http://{host}:{port}")
    return urls


def service_urls(slices: list[Mapping[str, Any]], port_name: str = "http", kind: str = "kvharbor") -> list[str]:
    """Ready engine URLs of one Service's slices. A dual-stack Service has an IPv4 and an IPv6
    slice for the same pods: only one family is used, or every engine would count twice."""
    families = {es.get("addressType") for es in slices}
    family = "IPv4" if "IPv4" in families else None
    chosen = [es for es in slices if family is None or es.get("addressType") == family]
    return sorted({url for es in chosen for url in slice_urls(es, port_name, kind)})
