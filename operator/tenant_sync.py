"""Every Tenant (and the Secret holding its keys) -> the one Secret the gateway reads its tenants from.

The whole file is rebuilt from all Tenants each time, so a deleted Tenant simply drops out and a
rotated key shows up at the next pass; `Kube.ensure` writes only when the file changed. A Tenant
that cannot be turned into a gateway tenant (missing Secret, empty key, a name another namespace
already uses) is left out, and its status says why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvharbor.common.kube import Kube, path
from kvharbor.operator.status import rfc3339, set_condition
from kvharbor.operator.tenants import TenantError, gateway_tenant, gateway_tenants_secret

TENANTS_API = "kvharbor.io/v1alpha1"


@dataclass(frozen=True)
class TenantSync:
    written: str  # created | updated | unchanged
    problems: dict[tuple[str, str], str]  # (namespace, name) -> why it is not in the gateway's file
    tenants: list[dict]


async def sync_tenants(
    kube: Kube, secret_name: str, secret_namespace: str, namespaces: Iterable[str] = ()
) -> TenantSync:
    tenants = await list_tenants(kube, list(namespaces))
    entries: list[dict] = []
    problems: dict[tuple[str, str], str] = {}
    owners: dict[str, str] = {}
    for tenant in sorted(tenants, key=lambda t: (t["metadata"]["namespace"], t["metadata"]["name"])):
        meta = tenant["metadata"]
        key = (meta["namespace"], meta["name"])
        if meta.get("deletionTimestamp"):
            continue
        if meta["name"] in owners:
            problems[key] = f"tenant name {meta['name']!r} is already used in namespace {owners[meta['name']]!r}"
            continue
        try:
            entries.append(gateway_tenant(tenant, await key_secret(kube, tenant)))
            owners[meta["name"]] = meta["namespace"]
        except TenantError as exc:
            problems[key] = str(exc)
    written = await kube.ensure(gateway_tenants_secret(secret_name, secret_namespace, entries))
    return TenantSync(written, problems, tenants)


async def list_tenants(kube: Kube, namespaces: list[str]) -> list[dict]:
    if not namespaces:
        return await kube.list(path(TENANTS_API, "Tenant"))
    found = []
    for namespace in namespaces:
        found += await kube.list(path(TENANTS_API, "Tenant", namespace))
    return found


async def key_secret(kube: Kube, tenant: dict) -> dict:
    meta, ref = tenant["metadata"], (tenant.get("spec") or {}).get("apiKeySecretRef") or {}
    if not ref.get("name"):
        raise TenantError("spec.apiKeySecretRef.name is empty: name the Secret that holds the API key")
    secret = await kube.get(path("v1", "Secret", meta["namespace"], ref["name"]))
    if secret is None:
        raise TenantError(f"Secret {meta['namespace']}/{ref['name']} not found: create it with the API key")
    return secret


async def report_status(kube: Kube, sync: TenantSync) -> list[tuple[dict, bool, str]]:
    """Patch each Tenant's Ready condition when it changed; returns (tenant, ready, message) of those."""
    now, changed = rfc3339(), []
    for tenant in sync.tenants:
        meta = tenant["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        problem = sync.problems.get((meta["namespace"], meta["name"]))
        message = problem or "in the gateway's tenants file"
        old = (tenant.get("status") or {}).get("conditions") or []
        conds = set_condition(old, "Ready", problem is None, "Invalid" if problem else "Synced", message, now)
        generation = meta.get("generation", 1)
        if conds == old and (tenant.get("status") or {}).get("observedGeneration") == generation:
            continue
        url = path(TENANTS_API, "Tenant", meta["namespace"], meta["name"]) + "/status"
        await kube.merge_patch(url, {"status": {"conditions": conds, "observedGeneration": generation}})
        changed.append((tenant, problem is None, message))
    return changed
