"""What the operator does for an InferenceService, as plain async functions (kopf calls them
from operator/handlers.py; nothing here imports kopf).

- `reconcile_service`: place each engine role (operator/roles.py: one colocated, or prefill and
  decode) on a node pool, then create or update the engine objects (`desired_objects`) and
  delete the ones a former mode left (a colocated Deployment once the service is disaggregated,
  or the reverse); when nothing fits, deploy nothing and say why.
- `observe_service` (on a timer): readiness from each role's Deployment, engine URLs from the
  Service's EndpointSlices, load from each engine's /load, then `scale_decision` per role on the
  reports of that role's engines only, so scaling one role never moves the other, and
  `status.adapters` from the LoRA adapters the engines report; it re-runs placement while the
  service is unplaced, since new nodes may have joined.
- `finalize_service` (the finalizer): scale to zero, wait until the engine pods are gone (they
  drain), then remove their instances from the KV index so no router sends anyone there.

Each returns an `Outcome`: fields to merge into .status and events to post.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvharbor.common.endpoint_slices import SERVICE_NAME_LABEL, service_urls
from kvharbor.common.kube import Kube, NotOwned, path
from kvharbor.common.load_report import LoadReport
from kvharbor.common.vllm_metrics import load_from_vllm_metrics
from kvharbor.operator.adapters import adapters_status, lora_spec
from kvharbor.operator.config import OperatorConfig
from kvharbor.operator.model_profiles import profile_for
from kvharbor.operator.objects import deployment_name, desired_objects, engine_selector, object_names
from kvharbor.operator.placement import EngineShape, PlacementPlan, place, pools_from_nodes
from kvharbor.operator.roles import ALL_ROLES, COLOCATED, RoleSpec, role_specs
from kvharbor.operator.scaling import AutoscalingSpec, observed, scale_decision
from kvharbor.operator.status import (
    Event,
    Outcome,
    is_true,
    parse_rfc3339,
    phase,
    rfc3339,
    set_condition,
    transition_events,
)
from kvharbor.operator.vllm_pods import engine_kind, gpu_memory_utilization


class Pending(RuntimeError):
    """Not done yet; try again in `delay` seconds (the message says what it waits for)."""

    def __init__(self, message: str, delay: float = 5.0, events: list[Event] | None = None) -> None:
        super().__init__(message)
        self.delay = delay
        self.events = events or []  # decided before it had to wait; post them anyway


@dataclass
class OperatorContext:
    config: OperatorConfig
    kube: Kube
    http: httpx.AsyncClient  # for the engines' /load
    index: Any | None = None  # a kvcache_service Index, when redis_url is set
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lock(self, body: Any) -> asyncio.Lock:
        """One lock per object: kopf runs a change handler and a timer of the same object at once."""
        return self.locks.setdefault(body["metadata"]["uid"], asyncio.Lock())

    async def close(self) -> None:
        await self.kube.close()
        await self.http.aclose()
        if self.index is not None:
            await self.index.close()


@dataclass(frozen=True)
class Resource:
    """The parts of an InferenceService object every function needs."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: dict
    status: dict

    @classmethod
    def of(cls, body: dict) -> Resource:
        meta = body["metadata"]
        return cls(
            meta["name"], meta["namespace"], meta["uid"], int(meta.get("generation") or 1),
            dict(body.get("spec") or {}), dict(body.get("status") or {}),
        )  # fmt: skip

    def deployment_path(self, role: str = COLOCATED) -> str:
        api_version, name = object_names(self.name, role)["Deployment"]
        return path(api_version, "Deployment", self.namespace, name)

    def section(self, key: str) -> dict:
        return dict(self.spec.get(key) or {})

    def role_status(self, role: str) -> dict:
        """What .status says of one role: a colocated service keeps it at the top, a
        disaggregated one under status.roles.<role>."""
        if role == COLOCATED:
            return self.status
        return dict((self.status.get("roles") or {}).get(role) or {})


def mode_status(res: Resource, per_role: dict[str, dict]) -> dict:
    """Per-role status fields where the service's mode keeps them: at the top for a colocated
    service; under `roles`, with replica sums at the top, for a disaggregated one. The other
    mode's fields are cleared (a merge patch removes nulls), so a service that changed mode
    shows no stale numbers."""
    if COLOCATED in per_role:
        out = dict(per_role[COLOCATED])
        return out | ({"roles": None} if "roles" in res.status else {})
    out: dict[str, Any] = {"roles": per_role}
    for key in ("desiredReplicas", "readyReplicas"):
        values = [fields[key] for fields in per_role.values() if key in fields]
        if values:
            out[key] = sum(values)
    return out | {key: None for key in ("placement", "lastScaleTime") if key in res.status}


def engine_shape(res: Resource) -> EngineShape:
    """What placement sizes; raises ValueError on a bad spec.adapters or spec.lora."""
    model, engine, lora = res.section("model"), res.section("engine"), lora_spec(res.spec)
    return EngineShape(
        dtype=model.get("dtype", "bfloat16"),
        max_model_len=int(model.get("maxModelLen", 4096)),
        max_num_seqs=int(engine.get("maxNumSeqs", 64)),
        kv_memory_fraction=float(engine.get("kvMemoryFraction", 0.9)),
        quantization=res.spec.get("quantization", "none"),
        kv_cache_dtype=res.spec.get("kvCacheDtype", "auto"),
        gguf_bits=int(res.spec.get("ggufBits", 8)),
        gpu_memory_utilization=gpu_memory_utilization(res.spec) if engine_kind(res.spec) == "vllm" else None,
        **lora.shape(),
    )


async def plan_placement(ctx: OperatorContext, res: Resource) -> dict[str, PlacementPlan] | str:
    """Each role's placement, or why there is none (bad spec, or no pool fits some role)."""
    model = res.section("model")
    try:
        roles = role_specs(res.spec)
        profile = profile_for(model["name"], model.get("profile"))
        shape = engine_shape(res)
        profile.weight_bytes(shape.dtype, shape.quantization, shape.gguf_bits)  # what it cannot size is a bad spec
        profile.kv_bytes_per_token(shape.dtype, shape.kv_cache_dtype)
        if shape.lora_slots:
            profile.lora_parameters_per_rank()
    except (KeyError, ValueError) as exc:
        return f"invalid spec: {exc}"
    pools = pools_from_nodes(await ctx.kube.list(path("v1", "Node")), ctx.config.watch.pool_label)
    plans, reasons = {}, []
    for role in roles:
        plan = place(
            profile,
            shape,
            pools,
            node_pool=role.placement.get("nodePool"),
            gpu_type=role.resources.get("gpuType"),
            gpus_per_replica=role.resources.get("gpusPerReplica"),
        )
        if isinstance(plan, list):
            reasons.append(("" if role.role == COLOCATED else f"{role.role} engines: ") + "; ".join(plan))
        else:
            plans[role.role] = plan
    return "no node pool fits: " + " | ".join(reasons) if reasons else plans


def placement_status(plan: PlacementPlan) -> dict:
    status = {
        "pool": plan.pool,
        "gpusPerReplica": plan.gpus_per_replica,
        "kvCapacityTokens": plan.kv_capacity_tokens,
        "bytesPerToken": plan.bytes_per_token,
        "weightBytes": plan.weight_bytes,
    }
    if plan.adapter_bytes:  # only with adapters: a service without them keeps its status as it was
        status["adapterBytes"] = plan.adapter_bytes
    return status


async def reconcile_service(ctx: OperatorContext, body: dict) -> Outcome:
    res, now = Resource.of(body), rfc3339()
    old = list(res.status.get("conditions") or [])
    plans = await plan_placement(ctx, res)
    if isinstance(plans, str):
        reason = "InvalidSpec" if plans.startswith("invalid spec") else "NoFit"
        conds = set_condition(old, "Placed", False, reason, plans, now)
        conds = set_condition(conds, "Ready", False, "NotPlaced", "nothing is deployed until a node pool fits", now)
        status = {"conditions": conds, "phase": phase(conds), "observedGeneration": res.generation}
        return Outcome(status, transition_events(old, conds))
    replicas = {role.role: await start_replicas(ctx, res, role) for role in role_specs(res.spec)}
    engine = ctx.config.engine
    objects = desired_objects(
        res.name, res.namespace, res.uid, res.spec, plans, replicas,
        engine.engine_image, engine.redis_url, ctx.config.watch.pool_label,
        (engine.engine_redis_secret, engine.engine_redis_secret_key) if engine.engine_redis_secret else None,
        engine.vllm_image,
    )  # fmt: skip
    moved = [role for role, plan in plans.items() if placement_changed(res, role, plan)]
    events = [Event("Normal", "Placed", placement_message(role, plans[role])) for role in moved]
    changed, conflicts = [], []
    for obj in objects:
        try:
            result = await ctx.kube.ensure(obj, owner_uid=res.uid)
        except NotOwned as exc:
            conflicts.append(str(exc))
            continue
        if result != "unchanged":
            changed.append(f"{obj['kind']} {obj['metadata']['name']}")
            events.append(Event("Normal", result.capitalize(), f"{obj['kind']} {obj['metadata']['name']} {result}"))
    for gone in await remove_former_roles(ctx, res, set(plans)):
        changed.append(gone)
        events.append(Event("Normal", "Deleted", f"{gone} deleted: the service no longer runs that role"))
    placed = "; ".join(placement_message(role, plan) for role, plan in plans.items())
    conds = set_condition(old, "Placed", True, "Fits", placed, now)
    if changed:
        conds = set_condition(conds, "Progressing", True, "ObjectsApplied", "applied " + ", ".join(changed), now)
    if conflicts:  # rename the InferenceService, or remove the other object
        conds = set_condition(conds, "Degraded", True, "NameConflict", "; ".join(conflicts), now)
    per_role = {role: {"placement": placement_fields(res, role, plan), "desiredReplicas": replicas[role]}
                for role, plan in plans.items()}  # fmt: skip
    status = {
        "conditions": conds,
        "phase": phase(conds),
        **mode_status(res, per_role),
        "observedGeneration": res.generation,
    }
    return Outcome(status, events + transition_events(old, conds))


async def start_replicas(ctx: OperatorContext, res: Resource, role: RoleSpec) -> int:
    """The role's replicas: what its Deployment runs (autoscaling set it), within the bounds."""
    current = await ctx.kube.get(res.deployment_path(role.role))
    return role.clamp(int((current or {}).get("spec", {}).get("replicas", role.start_replicas)))


async def remove_former_roles(ctx: OperatorContext, res: Resource, roles: set[str]) -> list[str]:
    """Delete the owned ConfigMap, Deployment and PDB of roles the service no longer runs (the
    Service is shared by every role): a colocated Deployment would keep serving, and PDBs that
    overlap on a pod block its eviction."""
    gone = []
    for role in ALL_ROLES:
        if role in roles:
            continue
        for kind, (api_version, name) in object_names(res.name, role).items():
            if kind == "Service":
                continue
            url = path(api_version, kind, res.namespace, name)
            obj = await ctx.kube.get(url) or {}
            owners = [o.get("uid") for o in obj.get("metadata", {}).get("ownerReferences") or []]
            if res.uid in owners and await ctx.kube.delete(url):
                gone.append(f"{kind} {name}")
    return gone


def placement_fields(res: Resource, role: str, plan: PlacementPlan) -> dict:
    """placement_status for a merge patch: it clears adapterBytes once the adapters are gone."""
    fields = placement_status(plan)
    if "adapterBytes" not in fields and "adapterBytes" in (res.role_status(role).get("placement") or {}):
        fields["adapterBytes"] = None
    return fields


def placement_message(role: str, plan: PlacementPlan) -> str:
    text = (
        f"pool {plan.pool} ({plan.gpu_product or 'GPU'}), {plan.gpus_per_replica} GPU(s) per replica, "
        f"weights {plan.weight_bytes / 2**30:.1f} GiB, "
        + (f"adapters {plan.adapter_bytes / 2**30:.2f} GiB, " if plan.adapter_bytes else "")
        + f"KV capacity {plan.kv_capacity_tokens} tokens at {plan.bytes_per_token} bytes/token"
    )
    return text if role == COLOCATED else f"{role} engines: {text}"


def placement_changed(res: Resource, role: str, plan: PlacementPlan) -> bool:
    return res.role_status(role).get("placement") != placement_status(plan)


async def missing_objects(ctx: OperatorContext, res: Resource, roles: tuple[RoleSpec, ...]) -> list[str]:
    """Owned objects other than the Deployments that someone deleted (the caller read those)."""
    names = [object_names(res.name, role.role) for role in roles]
    owned = {(kind, *ref) for of_role in names for kind, ref in of_role.items() if kind != "Deployment"}
    missing = []
    for kind, api_version, name in sorted(owned):  # the Service once: every role shares it
        if await ctx.kube.get(path(api_version, kind, res.namespace, name)) is None:
            missing.append(f"{kind} {name}")
    return missing


async def engine_urls(ctx: OperatorContext, res: Resource) -> list[str]:
    slices = await ctx.kube.list(
        path("discovery.k8s.io/v1", "EndpointSlice", res.namespace), f"{SERVICE_NAME_LABEL}={res.name}"
    )
    return service_urls(slices)


async def engine_loads(
    ctx: OperatorContext, urls: list[str], kind: str = "kvharbor"
) -> tuple[list[LoadReport], list[str]]:
    """/load of every engine (vLLM pods: their /metrics, as the gateway reads them): the
    answers, and the URLs that did not answer (or not a report)."""

    async def one(url: str) -> LoadReport | None:
        try:
            if kind == "vllm":
                response = await ctx.http.get(f"{url}/metrics", timeout=ctx.config.watch.load_timeout)
                response.raise_for_status()
                return load_from_vllm_metrics(response.text, url)
            response = await ctx.http.get(f"{url}/load", timeout=ctx.config.watch.load_timeout)
            response.raise_for_status()
            return LoadReport.from_json(response.json())
        except (httpx.HTTPError, ValueError):
            return None

    answers = await asyncio.gather(*(one(u) for u in urls))
    return [a for a in answers if a is not None], [u for u, a in zip(urls, answers, strict=True) if a is None]


async def observe_service(ctx: OperatorContext, body: dict, now: float | None = None) -> Outcome:
    if body["metadata"].get("deletionTimestamp"):
        return Outcome()  # the finalizer owns it now: scaling back up would undo its drain
    res = Resource.of(body)
    conds = list(res.status.get("conditions") or [])
    try:
        roles, lora = role_specs(res.spec), lora_spec(res.spec)
    except ValueError:
        return await reconcile_service(ctx, body)  # it says what is wrong with the spec
    deployments = {role.role: await ctx.kube.get(res.deployment_path(role.role)) for role in roles}
    if not is_true(conds, "Placed") or None in deployments.values() or await missing_objects(ctx, res, roles):
        return await reconcile_service(ctx, body)  # unplaced (nodes may have come), or an object was removed
    now = time.time() if now is None else now
    urls = await engine_urls(ctx, res)
    loads, silent = await engine_loads(ctx, urls, engine_kind(res.spec))
    outcome, wanted, per_role = Outcome(), {}, {}
    for role in roles:
        deployment = deployments[role.role]
        desired = int(deployment.get("spec", {}).get("replicas", 0))
        fields: dict[str, Any] = {}  # this role's status; autoscale adds its lastScaleTime
        wanted[role.role] = await autoscale(ctx, res, role, desired, loads, now, outcome, fields)
        ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
        per_role[role.role] = {**fields, "readyReplicas": ready, "desiredReplicas": wanted[role.role]}
    new = readiness(conds, roles, deployments, wanted, silent)
    outcome.status.update(conditions=new, phase=phase(new), endpoints=urls, **mode_status(res, per_role))
    adapters = adapters_status(lora, loads)
    if adapters or "adapters" in res.status:
        outcome.status["adapters"] = adapters or None  # a merge patch removes a null
    outcome.events += transition_events(conds, new)
    return outcome


async def autoscale(
    ctx: OperatorContext,
    res: Resource,
    role: RoleSpec,
    desired: int,
    loads: list[LoadReport],
    now: float,
    outcome: Outcome,
    fields: dict,
) -> int:
    """Patch the role's Deployment replicas when the scaling rule says so; returns the replicas
    wanted. It reads only the reports of that role's engines and keeps its own last-scale time
    (in `fields`, the role's status), so one role's load or cool-down never moves the other."""
    scaling = ctx.config.scaling
    spec = AutoscalingSpec(role.min_replicas, role.max_replicas, role.metric, role.target,
                           scaling.scale_up_cooldown, scaling.scale_down_cooldown)  # fmt: skip
    value = observed(spec.metric, [load for load in loads if load.role == role.role])
    last = parse_rfc3339(res.role_status(role.role).get("lastScaleTime")) or 0.0
    wanted = scale_decision(value, spec, desired, now, last)
    if wanted != desired:
        await ctx.kube.merge_patch(res.deployment_path(role.role), {"spec": {"replicas": wanted}})
        shown = "no data" if value is None else f"{value:.2f}"
        message = f"{desired} -> {wanted} replicas: {spec.metric} {shown} per replica, target {spec.target:g}"
        prefix = "" if role.role == COLOCATED else f"{role.role} engines: "
        outcome.events.append(Event("Normal", "Scaled", prefix + message))
        fields["lastScaleTime"] = rfc3339(now)
    return wanted


def readiness(
    conds: list[dict],
    roles: tuple[RoleSpec, ...],
    deployments: dict[str, dict],
    wanted: dict[str, int],
    silent: list[str],
) -> list[dict]:
    """Ready / Progressing / Degraded from the Deployments' status and the engines' answers:
    Ready when every role has the engines it needs."""
    now, all_ready, rolling, readies, rollouts = rfc3339(), True, False, [], []
    for role in roles:
        status, want = deployments[role.role].get("status") or {}, wanted[role.role]
        ready, updated = int(status.get("readyReplicas") or 0), int(status.get("updatedReplicas") or 0)
        need = max(1, role.min_replicas) if want else 0
        all_ready &= ready >= need
        rolling |= updated < want or ready < want
        prefix = "" if role.role == COLOCATED else f"{role.role}: "
        readies.append(f"{prefix}{ready}/{want} engine replicas ready (at least {need} needed)")
        rollouts.append(f"{prefix}{updated} updated, {ready} ready, {want} wanted")
    conds = set_condition(conds, "Ready", all_ready, "EnginesReady" if all_ready else "WaitingForEngines",
                          "; ".join(readies), now)  # fmt: skip
    conds = set_condition(conds, "Progressing", rolling, "RollingOut" if rolling else "Stable",
                          "; ".join(rollouts), now)  # fmt: skip
    if silent:
        return set_condition(conds, "Degraded", True, "EnginesSilent", f"no /load answer from {', '.join(silent)}", now)
    return set_condition(conds, "Degraded", False, "Healthy", "every ready engine answers", now)


def is_engine_pod_name(service: str, instance: str) -> bool:
    """Engine instance ids are their pod names: (<engine Deployment>-<template hash>-) cut to 58
    characters, as Kubernetes cuts a generated name's base, then 5 random characters. Any role's
    Deployment counts: the service may have changed mode while its engines published."""
    base, suffix = instance[:-5], instance[-5:]
    if not re.fullmatch(r"[a-z0-9]{5}", suffix) or len(base) > 58:
        return False
    return any(_is_pod_base(base, f"{deployment_name(service, role)}-") for role in ALL_ROLES)


def _is_pod_base(base: str, prefix: str) -> bool:
    if len(base) < 58:
        return base.startswith(prefix) and re.fullmatch(r"[a-z0-9]{1,10}-", base[len(prefix) :]) is not None
    if len(prefix) >= 58:
        return base == prefix[:58]
    return base.startswith(prefix) and re.fullmatch(r"[a-z0-9]{0,10}-?", base[len(prefix) :]) is not None


async def finalize_service(ctx: OperatorContext, body: dict) -> Outcome:
    res, outcome = Resource.of(body), Outcome()
    draining = False
    for role in ALL_ROLES:  # every role it may have run: its mode may have changed
        deployment = await ctx.kube.get(res.deployment_path(role))
        if deployment is not None and deployment.get("spec", {}).get("replicas") != 0:
            await ctx.kube.merge_patch(res.deployment_path(role), {"spec": {"replicas": 0}})
            draining = True
    if draining:
        outcome.events.append(Event("Normal", "Draining", "scaled the engines to 0 so they drain before cleanup"))
    selector = ",".join(f"{k}={v}" for k, v in engine_selector(res.name).items())
    # Failed or Succeeded pods (evicted, OOM-killed) stay until someone deletes them, and run nothing.
    pods = [
        p for p in await ctx.kube.list(path("v1", "Pod", res.namespace), selector)
        if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]  # fmt: skip
    if pods:
        names = ", ".join(sorted(p["metadata"]["name"] for p in pods))
        message = f"waiting for {len(pods)} engine pod(s) to stop before clearing the KV index: {names}"
        raise Pending(message, events=outcome.events)
    model = res.section("model").get("name", "")
    if ctx.index is None:
        outcome.events.append(Event("Normal", "IndexSkipped", "no redis_url configured: no KV index to clear"))
        return outcome
    from kvharbor.kvcache_service.index import IndexUnavailable

    try:
        instances = await ctx.index.instances()
        gone = [i.instance for i in instances if i.model == model and is_engine_pod_name(res.name, i.instance)]
        removed = await ctx.index.forget(model, gone)
    except IndexUnavailable as exc:
        raise Pending(f"KV index unreachable, will retry: {exc}", delay=15.0) from None
    outcome.events.append(
        Event("Normal", "IndexCleared", f"removed {removed} engine instance(s) of {model} from the KV index")
    )
    return outcome
