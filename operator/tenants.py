"""Tenant resources -> the gateway's tenants file (gateway/tenants.py reads it).

The gateway reads tenants from a YAML file it re-reads on change; in Kubernetes that file is a
key of a Secret the operator writes from every Tenant and the Secrets their `apiKeySecretRef`
names. API keys never leave a Secret in clear: the gateway's file holds only their sha256.

`spec.adapters` (LoRA adapter names, or ["*"] for every adapter) becomes the entry's `adapters`
list; without it the entry has no such key, which the gateway reads as no adapter granted.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from kvharbor.common.api_keys import hash_key
from kvharbor.common.lora import check_adapter_name

TENANTS_KEY = "tenants.yaml"


class TenantError(ValueError):
    """A Tenant that cannot be turned into a gateway tenant; the message says why."""


def api_keys(secret: Mapping[str, Any], key: str) -> list[str]:
    """The API keys in a Secret's `data[key]` (base64, one key per line)."""
    raw = (secret.get("data") or {}).get(key)
    if raw is None:
        raise TenantError(f"Secret {secret.get('metadata', {}).get('name')!r} has no key {key!r}")
    try:
        text = base64.b64decode(raw, validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise TenantError(f"Secret key {key!r} is not base64 UTF-8 text") from None
    keys = [line.strip() for line in text.splitlines() if line.strip()]
    if not keys:
        raise TenantError(f"Secret key {key!r} holds no API key")
    return keys


def gateway_tenant(tenant: Mapping[str, Any], secret: Mapping[str, Any]) -> dict:
    """One entry of the gateway's tenants file for a Tenant resource."""
    spec = tenant.get("spec") or {}
    ref = spec.get("apiKeySecretRef") or {}
    limits = spec.get("limits") or {}
    entry = {
        "name": tenant["metadata"]["name"],
        "api_keys": [hash_key(k) for k in api_keys(secret, ref.get("key", "api-key"))],
        "priority": int(spec.get("priority", 0)),
        "limits": {"rpm": limits.get("rpm"), "tpm": limits.get("tpm"), "max_concurrent": limits.get("maxConcurrent")},
        "models": list(spec.get("models") or ["*"]),
        "cache_sharing_group": spec.get("cacheSharingGroup"),
    }
    adapters = granted_adapters(spec.get("adapters"))
    if adapters:  # NOTE: absent, not [], when none: files of tenants without adapters stay byte for byte
        entry["adapters"] = adapters
    caps = spec.get("caps") or {}
    if caps:  # absent when none, for the same reason
        names = {"maxTokens": "max_tokens", "n": "n", "promptTokens": "prompt_tokens", "bodyBytes": "body_bytes"}
        unknown = set(caps) - set(names)
        if unknown:
            raise TenantError(f"spec.caps takes {', '.join(names)}, got {sorted(unknown)}")
        entry["caps"] = {names[k]: v for k, v in sorted(caps.items())}
    return entry


def granted_adapters(raw: Any) -> list[str]:
    """The adapter names a Tenant's spec.adapters grants, sorted and unique, or ["*"] (all)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise TenantError(f"spec.adapters must be a list of adapter names or ['*'], got {raw!r}")
    if "*" in raw:
        if raw != ["*"]:
            raise TenantError(f"spec.adapters grants every adapter with ['*'] alone, got {raw!r}")
        return ["*"]
    try:
        return sorted({check_adapter_name(name) for name in raw})
    except ValueError as exc:
        raise TenantError(f"spec.adapters: {exc}") from None


def gateway_tenants_secret(name: str, namespace: str, entries: Iterable[dict]) -> dict:
    """The Secret the gateway mounts: its tenants file, entries sorted so that writing it twice changes nothing."""
    body = yaml.safe_dump({"tenants": sorted(entries, key=lambda e: e["name"])}, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "kvharbor-operator"},
        },
        "type": "Opaque",
        "data": {TENANTS_KEY: base64.b64encode(body.encode()).decode()},
    }
