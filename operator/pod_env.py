"""Environment entries the operator's containers share: pod fields (the kubelet fills them in,
and expands $(NAME) in args from them) and the engines' Redis URL from its Secret."""

from __future__ import annotations

from typing import Any


def pod_field(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


def redis_secret_env(redis_secret: tuple[str, str] | None) -> list[dict[str, Any]]:
    """KVHARBOR_REDIS_URL from (Secret name, key), so the URL and its password stay out of
    ConfigMaps and argv; nothing without a Secret."""
    if not redis_secret:
        return []
    secret, key = redis_secret
    return [{"name": "KVHARBOR_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}]
