"""A small async Kubernetes REST client: the operator's writes (kopf does its watching) and the
gateway's engine discovery.

It speaks plain JSON to the API server: get, list (with a label selector), create, JSON merge
patch and delete, plus `ensure(obj)`, which creates an object, patches it when the desired fields
drifted, and writes nothing when they did not. That last rule is what makes reconciling twice
change nothing: the API server adds defaults (protocol, clusterIP, ...), so "unchanged" means
every desired field is already there with the desired value, not that the objects are equal.

Credentials come from the `kubernetes` package's loaders: the in-cluster service account, else
the kubeconfig in $KUBECONFIG (read when called, not at import) or ~/.kube/config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

# The kinds the operator reads or writes, by plural; anything else is a programming error.
PLURALS = {
    "ConfigMap": "configmaps",
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Secret": "secrets",
    "Pod": "pods",
    "Node": "nodes",
    "EndpointSlice": "endpointslices",
    "InferenceService": "inferenceservices",
    "Tenant": "tenants",
    "Event": "events",
}
CLUSTER_SCOPED = {"Node"}


class KubeError(RuntimeError):
    """The API server refused a request; `code` is its HTTP status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class NotOwned(KubeError):
    """An object with the desired name exists but belongs to someone else: it is left alone."""


def path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """The REST path of a collection (no name) or of one object."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    scope = "" if kind in CLUSTER_SCOPED or namespace is None else f"/namespaces/{quote(namespace)}"
    tail = f"/{quote(name)}" if name else ""
    return f"{root}{scope}/{PLURALS[kind]}{tail}"


def object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])


def drifted(desired: Any, actual: Any) -> bool:
    """True when some desired field is missing or different in `actual` (extra fields are fine)."""
    if isinstance(desired, Mapping):
        return not isinstance(actual, Mapping) or any(drifted(v, actual.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            not isinstance(actual, list)
            or len(desired) != len(actual)
            or any(drifted(d, a) for d, a in zip(desired, actual, strict=True))
        )
    return desired != actual


class Kube:
    def __init__(self, client: httpx.AsyncClient, auth=None) -> None:
        self._client = client
        self._auth = auth  # () -> Authorization header value or None, asked per request (tokens rotate)

    @classmethod
    def from_environment(cls, timeout: float = 10.0) -> Kube:
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        cfg = k8s.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=cfg)
        except k8s_config.ConfigException:
            kubeconfig = os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0]
            try:
                k8s_config.load_kube_config(config_file=os.path.expanduser(kubeconfig), client_configuration=cfg)
            except (k8s_config.ConfigException, OSError) as exc:
                raise KubeError(0, f"no Kubernetes credentials: not in a cluster and {kubeconfig}: {exc}") from None
        verify: Any = (cfg.ssl_ca_cert or True) if cfg.verify_ssl else False
        cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file else None
        client = httpx.AsyncClient(base_url=cfg.host, verify=verify, cert=cert, timeout=timeout)
        return cls(client, auth=lambda: cfg.get_api_key_with_prefix("authorization"))

    async def _request(self, method: str, url: str, **kwargs) -> httpx.Response:
        headers = kwargs.pop("headers", {})
        token = self._auth() if self._auth else None
        if token:
            headers["Authorization"] = token
        try:
            return await self._client.request(method, url, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise KubeError(0, f"{method} {url}: Kubernetes API unreachable: {exc!r}") from exc

    async def _json(self, method: str, url: str, **kwargs) -> dict:
        response = await self._request(method, url, **kwargs)
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise KubeError(response.status_code, f"{method} {url}: {response.status_code} {message}")
        return response.json()

    async def get(self, url: str) -> dict | None:
        try:
            return await self._json("GET", url)
        except KubeError as exc:
            if exc.code == 404:
                return None
            raise

    async def list(self, url: str, label_selector: str | None = None) -> list[dict]:
        params = {"labelSelector": label_selector} if label_selector else None
        return (await self._json("GET", url, params=params)).get("items", [])

    async def create(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return await self._json("POST", url, json=obj)

    async def merge_patch(self, url: str, patch: Mapping[str, Any]) -> dict:
        headers = {"Content-Type": "application/merge-patch+json"}
        return await self._json("PATCH", url, content=json.dumps(patch).encode(), headers=headers)

    async def delete(self, url: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            await self._json("DELETE", url)
            return True
        except KubeError as exc:
            if exc.code == 404:
                return False
            raise

    async def ensure(self, obj: Mapping[str, Any], owner_uid: str | None = None) -> str:
        """Make `obj` exist with its fields: 'created', 'updated' or 'unchanged'. With `owner_uid`,
        an existing object that this owner does not own raises NotOwned instead of being taken over."""
        url = object_path(obj)
        current = await self.get(url)
        if current is not None and owner_uid is not None:
            owners = [o.get("uid") for o in current.get("metadata", {}).get("ownerReferences") or []]
            if owner_uid not in owners:
                raise NotOwned(409, f"{obj['kind']} {obj['metadata']['name']} exists and is not owned by this resource")
        if current is None:
            try:
                await self.create(obj)
                return "created"
            except KubeError as exc:
                if exc.code != 409:
                    raise
                current = await self.get(url)  # created meanwhile by someone else: compare with theirs
                if current is None:
                    raise
        if not drifted(_writable(obj), current):
            return "unchanged"
        # A JSON merge patch replaces lists whole (containers, tolerations), which is what we
        # want for fields we own, and leaves fields others added (annotations, clusterIP) alone.
        await self.merge_patch(url, _writable(obj))
        return "updated"

    async def close(self) -> None:
        await self._client.aclose()


def _writable(obj: Mapping[str, Any]) -> dict:
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "status")}
