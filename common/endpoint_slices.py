"""Engine URLs from EndpointSlices (discovery.k8s.io/v1): what the gateway routes to and the
operator polls for load. Only endpoints whose `ready` condition is not false count, as kube-proxy
does, so a draining pod (terminating, not ready) gets no new requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set on every slice by the EndpointSlice controller


def slice_urls(endpoint_slice: Mapping[str, Any], port_name: str = "http") -> list[str]:
    """The ready endpoints of one slice as http://ADDRESS:PORT (IPv6 addresses in brackets)."""
    ports = endpoint_slice.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") in (port_name, None)), None)
    if port is None:
        return []
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            host = f"[{address}]" if ":" in address else address
            urls.append(f"http://{host}:{port}")
    return urls
