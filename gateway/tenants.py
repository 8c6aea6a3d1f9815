"""Tenants: who an API key belongs to, what it may use, and its limits.

    tenants:
      - name: acme
        api_keys: ["sha256:<hex of sha256(key)>"]   # keys are never stored in clear
        priority: 0                                  # below 0: sheddable
        limits: {rpm: 600, tpm: 200000, max_concurrent: 32}
        caps: {max_tokens: 4096, n: 4, prompt_tokens: 8000, body_bytes: 1000000}  # per request; each optional
        models: ["*"]                                # or a list of model ids
        adapters: []                                 # LoRA adapters it may ask for by name, or ["*"]; default none
        cache_sharing_group: null                    # tenants of one group share cached prefixes

`TenantRegistry` re-reads the file when it changes; a file that fails to parse keeps the last good
tenants in force (and says why in the log), so a typo never locks everyone out.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvharbor.common.api_keys import hash_key
from kvharbor.common.lora import check_adapter_name

log = logging.getLogger("kvharbor.gateway.tenants")
_KEY_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class TenantsError(ValueError):
    """The tenants file is not valid; the message names the tenant and field."""


@dataclass(frozen=True)
class Limits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Caps:
    """What one request of the tenant may ask for (None: the gateway's own limits only)."""

    max_tokens: int | None = None
    n: int | None = None
    prompt_tokens: int | None = None
    body_bytes: int | None = None


CAP_FIELDS = ("max_tokens", "n", "prompt_tokens", "body_bytes")
# Per cap: the request field it names, and what the 400 says ({v}: asked, {cap}: the cap).
_CAP_ERRORS = {
    "max_tokens": ("max_tokens", "max_tokens {v} is over this tenant's cap of {cap} (caps.max_tokens): ask for at most"
                   " {cap}"),
    "n": ("n", "n {v} is over this tenant's cap of {cap} (caps.n): ask for at most {cap} choices"),
    "prompt_tokens": ("messages", "the prompt has {v} tokens, over this tenant's cap of {cap} (caps.prompt_tokens):"
                      " shorten it"),
    "body_bytes": (None, "the request body is {v} bytes, over this tenant's cap of {cap} (caps.body_bytes)"),
}


def over_cap(caps: Caps, asked: dict[str, int | None]) -> tuple[str, str | None] | None:
    """The first cap a request's `asked` values (CAP_FIELDS -> value, None: not given) go over,
    as (message, param); None when they fit."""
    for name in CAP_FIELDS:
        cap, value = getattr(caps, name), asked.get(name)
        if cap is not None and value is not None and value > cap:
            param, template = _CAP_ERRORS[name]
            return template.format(v=value, cap=cap), param
    return None


@dataclass(frozen=True)
class Tenant:
    name: str
    api_keys: frozenset[str]
    priority: int = 0
    limits: Limits = field(default_factory=Limits)
    models: tuple[str, ...] = ("*",)
    cache_sharing_group: str | None = None
    # NOTE: none by default, unlike models: adapters are tenants' own fine-tunes, not shared.
    adapters: tuple[str, ...] = ()
    caps: Caps = field(default_factory=Caps)

    @property
    def cache_salt(self) -> str:
        """Blocks hash under this salt: tenants never hit each other's cache unless they share a group."""
        return f"group:{self.cache_sharing_group}" if self.cache_sharing_group else f"tenant:{self.name}"

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def may_use_adapter(self, adapter: str) -> bool:
        """Granted this LoRA adapter (by name); it must also be on a base model the tenant may use."""
        return "*" in self.adapters or adapter in self.adapters


def parse_tenants(data: Any) -> dict[str, Tenant]:
    """Tenants by key hash. Raises TenantsError on anything invalid."""
    if not isinstance(data, dict) or not isinstance(data.get("tenants"), list):
        raise TenantsError("the tenants file must hold a mapping with a 'tenants' list")
    by_key: dict[str, Tenant] = {}
    names: set[str] = set()
    for i, raw in enumerate(data["tenants"]):
        tenant = _parse_tenant(i, raw)
        if tenant.name in names:
            raise TenantsError(f"tenant {tenant.name!r} appears twice")
        names.add(tenant.name)
        for key in tenant.api_keys:
            if key in by_key:
                raise TenantsError(f"an API key of {tenant.name!r} also belongs to {by_key[key].name!r}")
            by_key[key] = tenant
    return by_key


def _parse_tenant(i: int, raw: Any) -> Tenant:
    where = f"tenants[{i}]"
    if not isinstance(raw, dict):
        raise TenantsError(f"{where} must be a mapping")
    unknown = set(raw) - {"name", "api_keys", "priority", "limits", "caps", "models", "adapters", "cache_sharing_group"}
    if unknown:
        raise TenantsError(f"{where}: unknown fields {sorted(unknown)}")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise TenantsError(f"{where}.name must be 1-63 letters, digits, '.', '_' or '-', got {name!r}")
    where = f"tenant {name!r}"
    keys = raw.get("api_keys") or []
    if not isinstance(keys, list) or not all(isinstance(k, str) and _KEY_HASH.match(k) for k in keys):
        raise TenantsError(
            f"{where}: api_keys must be a list of 'sha256:<64 hex>' hashes "
            "(python -c \"import hashlib; print('sha256:' + hashlib.sha256(b'KEY').hexdigest())\")"
        )
    priority = raw.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TenantsError(f"{where}: priority must be an integer, got {priority!r}")
    models = raw.get("models", ["*"])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise TenantsError(f"{where}: models must be a list of model ids or ['*']")
    group = raw.get("cache_sharing_group")
    if group is not None and (not isinstance(group, str) or not _NAME.match(group)):
        raise TenantsError(f"{where}: cache_sharing_group must be a name or null, got {group!r}")
    limits = _parse_limits(where, raw.get("limits") or {})
    return Tenant(
        name, frozenset(keys), priority, limits, tuple(models), group,
        adapters=_parse_adapters(where, raw), caps=_parse_caps(where, raw.get("caps") or {}),
    )  # fmt: skip


def _parse_adapters(where: str, raw: dict) -> tuple[str, ...]:
    adapters = raw.get("adapters")
    if adapters is None:
        return ()
    if not isinstance(adapters, list):
        raise TenantsError(f"{where}: adapters must be a list of LoRA adapter names or ['*'], got {adapters!r}")
    for name in adapters:
        if name == "*":
            continue
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise TenantsError(f"{where}: adapters: {exc}") from None
    return tuple(adapters)


def _parse_caps(where: str, raw: Any) -> Caps:
    if not isinstance(raw, dict) or set(raw) - set(CAP_FIELDS):
        raise TenantsError(f"{where}: caps takes {', '.join(CAP_FIELDS)}, got {raw!r}")
    for name, value in raw.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise TenantsError(f"{where}: caps.{name} must be a positive integer or null, got {value!r}")
    return Caps(**raw)


def _parse_limits(where: str, raw: Any) -> Limits:
    if not isinstance(raw, dict) or set(raw) - {"rpm", "tpm", "max_concurrent"}:
        raise TenantsError(f"{where}: limits takes rpm, tpm and max_concurrent, got {raw!r}")
    for name, value in raw.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise TenantsError(f"{where}: limits.{name} must be a positive integer or null, got {value!r}")
    return Limits(raw.get("rpm"), raw.get("tpm"), raw.get("max_concurrent"))


class TenantRegistry:
    """The tenants of a file, re-read when its modification time or size changes."""

    def __init__(self, path: str | Path | None, tenants: dict[str, Tenant] | None = None) -> None:
        self.path = Path(path) if path else None
        self._by_key: dict[str, Tenant] = tenants or {}
        self._stamp: tuple[int, int] | None = None
        self.reloads = 0
        self.last_error = ""
        if self.path is not None:
            self._by_key = self._read()  # the first read must succeed: fail at start-up, loudly
            self._stamp = self._file_stamp()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows symlinks: a Secret volume swaps its files by one
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _read(self) -> dict[str, Tenant]:
        try:
            data = yaml.safe_load(self.path.read_text())
        except FileNotFoundError:
            raise TenantsError(f"tenants file {self.path} does not exist") from None
        except yaml.YAMLError as exc:
            raise TenantsError(f"tenants file {self.path} is not valid YAML: {exc}") from None
        return parse_tenants(data)

    def refresh(self) -> bool:
        """Re-read the file if it changed; True when new tenants took effect."""
        if self.path is None:
            return False
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self._by_key = self._read()
        except TenantsError as exc:
            self.last_error = str(exc)
            log.error("tenants file changed but is invalid; keeping the previous tenants", extra={"error": str(exc)})
            return False
        self.reloads += 1
        self.last_error = ""
        log.info("tenants reloaded", extra={"tenants": len({t.name for t in self._by_key.values()})})
        return True

    def authenticate(self, key: str) -> Tenant | None:
        return self._by_key.get(hash_key(key))

    @property
    def tenants(self) -> list[Tenant]:
        return sorted({t.name: t for t in self._by_key.values()}.values(), key=lambda t: t.name)
