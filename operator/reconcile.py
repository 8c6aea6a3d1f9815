"""What the operator does for an InferenceService, as plain async functions (kopf calls them
from operator/handlers.py; nothing here imports kopf).

- `reconcile_service`: place the model on a node pool, then create or update the engine objects
  (`desired_objects`); when nothing fits, deploy nothing and say why.
- `observe_service` (on a timer): readiness from the Deployment, engine URLs from the Service's
  EndpointSlices, load from each engine's /load, then `scale_decision`; it re-runs placement
  while the service is unplaced, since new nodes may have joined.
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
from kvharbor.operator.config import OperatorConfig
from kvharbor.operator.model_profiles import profile_for
from kvharbor.operator.objects import desired_objects, engine_selector, object_names
from kvharbor.operator.placement import EngineShape, PlacementPlan, place, pools_from_nodes
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

    @property
    def deployment_path(self) -> str:
        api_version, name = object_names(self.name)["Deployment"]
        return path(api_version, "Deployment", self.namespace, name)

    def section(self, key: str) -> dict:
        return dict(self.spec.get(key) or {})


DEFAULT_TARGETS = {"queue": 8.0, "kv": 0.8, "slo": 0.95}


def autoscaling_target(res: Resource) -> tuple[str, float]:
    """The metric and its target, defaulted per metric; kv and slo are shares in (0, 1]."""
    auto = res.section("autoscaling")
    metric = auto.get("metric", "queue")
    if metric not in DEFAULT_TARGETS:
        raise ValueError(f"autoscaling.metric must be queue, kv or slo, got {metric!r}")
    target = float(auto.get("target", DEFAULT_TARGETS[metric]))
    if target <= 0 or (metric != "queue" and target > 1):
        raise ValueError(f"autoscaling.target {target:g} does not fit metric {metric}: use a share in (0, 1]")
    return metric, target


def replica_bounds(res: Resource) -> tuple[int, int]:
    replicas = res.section("replicas")
    low, high = int(replicas.get("min", 1)), int(replicas.get("max", 1))
    if low > high:
        raise ValueError(f"replicas.min ({low}) is above replicas.max ({high}); set min <= max")
    return low, high


def engine_shape(res: Resource) -> EngineShape:
    model, engine = res.section("model"), res.section("engine")
    return EngineShape(
        dtype=model.get("dtype", "bfloat16"),
        max_model_len=int(model.get("maxModelLen", 4096)),
        max_num_seqs=int(engine.get("maxNumSeqs", 64)),
        kv_memory_fraction=float(engine.get("kvMemoryFraction", 0.9)),
        quantization=res.spec.get("quantization", "none"),
        kv_cache_dtype=res.spec.get("kvCacheDtype", "auto"),
        gguf_bits=int(res.spec.get("ggufBits", 8)),
    )


async def plan_placement(ctx: OperatorContext, res: Resource) -> PlacementPlan | str:
    """The placement, or why there is none (bad spec, or no pool fits)."""
    model, resources, placement = res.section("model"), res.section("resources"), res.section("placement")
    try:
        replica_bounds(res)
        autoscaling_target(res)
        profile = profile_for(model["name"], model.get("profile"))
        shape = engine_shape(res)
        profile.weight_bytes(shape.dtype, shape.quantization, shape.gguf_bits)  # what it cannot size is a bad spec
        profile.kv_bytes_per_token(shape.dtype, shape.kv_cache_dtype)
    except (KeyError, ValueError) as exc:
        return f"invalid spec: {exc}"
    nodes = await ctx.kube.list(path("v1", "Node"))
    plan = place(
        profile,
        shape,
        pools_from_nodes(nodes, ctx.config.watch.pool_label),
        node_pool=placement.get("nodePool"),
        gpu_type=resources.get("gpuType"),
        gpus_per_replica=resources.get("gpusPerReplica"),
    )
    return "no node pool fits: " + "; ".join(plan) if isinstance(plan, list) else plan


def placement_status(plan: PlacementPlan) -> dict:
    return {
        "pool": plan.pool,
        "gpusPerReplica": plan.gpus_per_replica,
        "kvCapacityTokens": plan.kv_capacity_tokens,
        "bytesPerToken": plan.bytes_per_token,
        "weightBytes": plan.weight_bytes,
    }


async def reconcile_service(ctx: OperatorContext, body: dict) -> Outcome:
    res, now = Resource.of(body), rfc3339()
    old = list(res.status.get("conditions") or [])
    plan = await plan_placement(ctx, res)
    if isinstance(plan, str):
        reason = "InvalidSpec" if plan.startswith("invalid spec") else "NoFit"
        conds = set_condition(old, "Placed", False, reason, plan, now)
        conds = set_condition(conds, "Ready", False, "NotPlaced", "nothing is deployed until a node pool fits", now)
        status = {"conditions": conds, "phase": phase(conds), "observedGeneration": res.generation}
        return Outcome(status, transition_events(old, conds))
    low, high = replica_bounds(res)
    current = await ctx.kube.get(res.deployment_path)
    replicas = min(high, max(low, int((current or {}).get("spec", {}).get("replicas", low))))
    engine = ctx.config.engine
    objects = desired_objects(
        res.name, res.namespace, res.uid, res.spec, plan, replicas,
        engine.engine_image, engine.redis_url, ctx.config.watch.pool_label,
    )  # fmt: skip
    events = [Event("Normal", "Placed", placement_message(plan))] if placement_changed(res, plan) else []
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
    conds = set_condition(old, "Placed", True, "Fits", placement_message(plan), now)
    if changed:
        conds = set_condition(conds, "Progressing", True, "ObjectsApplied", "applied " + ", ".join(changed), now)
    if conflicts:  # rename the InferenceService, or remove the other object
        conds = set_condition(conds, "Degraded", True, "NameConflict", "; ".join(conflicts), now)
    status = {
        "conditions": conds,
        "phase": phase(conds),
        "placement": placement_status(plan),
        "desiredReplicas": replicas,
        "observedGeneration": res.generation,
    }
    return Outcome(status, events + transition_events(old, conds))


def placement_message(plan: PlacementPlan) -> str:
    return (
        f"pool {plan.pool} ({plan.gpu_product or 'GPU'}), {plan.gpus_per_replica} GPU(s) per replica, "
        f"weights {plan.weight_bytes / 2**30:.1f} GiB, "
        f"KV capacity {plan.kv_capacity_tokens} tokens at {plan.bytes_per_token} bytes/token"
    )


def placement_changed(res: Resource, plan: PlacementPlan) -> bool:
    return res.status.get("placement") != placement_status(plan)


async def missing_objects(ctx: OperatorContext, res: Resource) -> list[str]:
    """Owned objects other than the Deployment that someone deleted (the caller read that one)."""
    missing = []
    for kind, (api_version, name) in object_names(res.name).items():
        if kind != "Deployment" and await ctx.kube.get(path(api_version, kind, res.namespace, name)) is None:
            missing.append(f"{kind} {name}")
    return missing


async def engine_urls(ctx: OperatorContext, res: Resource) -> list[str]:
    slices = await ctx.kube.list(
        path("discovery.k8s.io/v1", "EndpointSlice", res.namespace), f"{SERVICE_NAME_LABEL}={res.name}"
    )
    return service_urls(slices)


async def engine_loads(ctx: OperatorContext, urls: list[str]) -> tuple[list[LoadReport], list[str]]:
    """/load of every engine: the answers, and the URLs that did not answer (or not a report)."""

    async def one(url: str) -> LoadReport | None:
        try:
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
    deployment = await ctx.kube.get(res.deployment_path)
    if not is_true(conds, "Placed") or deployment is None or await missing_objects(ctx, res):
        return await reconcile_service(ctx, body)  # unplaced (nodes may have come), or an object was removed
    now = time.time() if now is None else now
    urls = await engine_urls(ctx, res)
    loads, silent = await engine_loads(ctx, urls)
    desired = int(deployment.get("spec", {}).get("replicas", 0))
    outcome = Outcome()
    wanted = await autoscale(ctx, res, desired, loads, now, outcome)
    ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
    new = readiness(res, conds, deployment, wanted, silent)
    outcome.status.update(conditions=new, phase=phase(new), readyReplicas=ready, desiredReplicas=wanted, endpoints=urls)
    outcome.events += transition_events(conds, new)
    return outcome


async def autoscale(
    ctx: OperatorContext, res: Resource, desired: int, loads: list[LoadReport], now: float, outcome: Outcome
) -> int:
    """Patch the Deployment's replicas when the scaling rule says so; returns the replicas wanted."""
    low, high = replica_bounds(res)
    metric, target = autoscaling_target(res)
    scaling = ctx.config.scaling
    spec = AutoscalingSpec(low, high, metric, target, scaling.scale_up_cooldown, scaling.scale_down_cooldown)
    value = observed(spec.metric, loads)
    last = parse_rfc3339(res.status.get("lastScaleTime")) or 0.0
    wanted = scale_decision(value, spec, desired, now, last)
    if wanted != desired:
        await ctx.kube.merge_patch(res.deployment_path, {"spec": {"replicas": wanted}})
        shown = "no data" if value is None else f"{value:.2f}"
        message = f"{desired} -> {wanted} replicas: {spec.metric} {shown} per replica, target {spec.target:g}"
        outcome.events.append(Event("Normal", "Scaled", message))
        outcome.status["lastScaleTime"] = rfc3339(now)
    return wanted


def readiness(res: Resource, conds: list[dict], deployment: dict, wanted: int, silent: list[str]) -> list[dict]:
    """Ready / Progressing / Degraded from the Deployment's status and the engines' answers."""
    now, status = rfc3339(), deployment.get("status") or {}
    ready, updated = int(status.get("readyReplicas") or 0), int(status.get("updatedReplicas") or 0)
    low, _ = replica_bounds(res)
    need = max(1, low) if wanted else 0
    conds = set_condition(conds, "Ready", ready >= need, "EnginesReady" if ready >= need else "WaitingForEngines",
                          f"{ready}/{wanted} engine replicas ready (at least {need} needed)", now)  # fmt: skip
    rolling = updated < wanted or ready < wanted
    conds = set_condition(conds, "Progressing", rolling, "RollingOut" if rolling else "Stable",
                          f"{updated} updated, {ready} ready, {wanted} wanted", now)  # fmt: skip
    if silent:
        return set_condition(conds, "Degraded", True, "EnginesSilent", f"no /load answer from {', '.join(silent)}", now)
    return set_condition(conds, "Degraded", False, "Healthy", "every ready engine answers", now)


def is_engine_pod_name(service: str, instance: str) -> bool:
    """Engine instance ids are their pod names: (<service>-engine-<template hash>-) cut to 58
    characters, as Kubernetes cuts a generated name's base, then 5 random characters."""
    base, suffix = instance[:-5], instance[-5:]
    if not re.fullmatch(r"[a-z0-9]{5}", suffix) or len(base) > 58:
        return False
    prefix = f"{service}-engine-"
    if len(base) < 58:
        return base.startswith(prefix) and re.fullmatch(r"[a-z0-9]{1,10}-", base[len(prefix) :]) is not None
    if len(prefix) >= 58:
        return base == prefix[:58]
    return base.startswith(prefix) and re.fullmatch(r"[a-z0-9]{0,10}-?", base[len(prefix) :]) is not None


async def finalize_service(ctx: OperatorContext, body: dict) -> Outcome:
    res, outcome = Resource.of(body), Outcome()
    deployment = await ctx.kube.get(res.deployment_path)
    if deployment is not None and deployment.get("spec", {}).get("replicas") != 0:
        await ctx.kube.merge_patch(res.deployment_path, {"spec": {"replicas": 0}})
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
