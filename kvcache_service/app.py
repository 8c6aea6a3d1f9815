"""The KV cache service's HTTP API: prefix lookups, instances, stats, metrics, health.

    POST /lookup     {model, block_hashes | token_ids [+ cache_salt, adapter, block_size], instances?, tier?}
                     -> {model, blocks, matches: {instance: matched_blocks}} (instances holding none: absent)
    GET  /instances  every instance in the index, alive or waiting to be swept
    GET  /stats      index, intake, shared store and reuse figures
    GET  /metrics    the same for Prometheus;  GET /health (alive), GET /ready (Redis answers, intake runs)

With --admin-port, /instances, /stats and /metrics answer there only (the probes on both ports).

While Redis is away, /ready is 503 and lookups answer 503 (`index_unavailable`, Retry-After) within
the Redis timeout: the gateway then routes by load alone.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.exceptions import RedisError

from kvharbor.common.admin_listener import ListenerSplit
from kvharbor.common.block_hash import block_hashes, from_hex
from kvharbor.common.http_errors import BodyGuardMiddleware, install_error_handlers
from kvharbor.common.openai_api import APIError
from kvharbor.kvcache_service.block_store import BlockStoreUnavailable, RedisBlockStore
from kvharbor.kvcache_service.consumer import EventConsumer
from kvharbor.kvcache_service.index import IndexUnavailable
from kvharbor.kvcache_service.metrics import ServiceMetrics
from kvharbor.kvcache_service.redis_index import RedisIndex
from kvharbor.kvcache_service.reuse_stats import read_all

log = logging.getLogger("kvharbor.kvcache.api")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
RETRY_AFTER_S = "1"


class LookupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    block_hashes: list[str] | None = None
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    adapter: str | None = None  # a LoRA adapter's identity (name@digest, from the engines' /load)
    block_size: int | None = Field(default=None, ge=1, le=4096)
    instances: list[str] | None = None
    tier: Literal["device", "shared"] = "device"

    @model_validator(mode="after")
    def _one_input(self) -> LookupRequest:
        if (self.block_hashes is None) == (self.token_ids is None):
            raise ValueError("give exactly one of block_hashes (hex digests) or token_ids (+ cache_salt)")
        if self.block_hashes is not None and (self.cache_salt, self.adapter, self.block_size) != (None, None, None):
            raise ValueError("cache_salt, adapter and block_size apply to token_ids only; block hashes carry them")
        bad = next((h for h in self.block_hashes or () if not _HEX32.match(h)), None)
        if bad is not None:
            raise ValueError(f"block hash {bad[:40]!r} is not 32 lowercase hex digits")
        if any(not 0 <= t < 2**31 for t in self.token_ids or ()):
            raise ValueError("token ids must be in [0, 2**31)")
        return self


@dataclass
class ServiceState:
    index: RedisIndex
    store: RedisBlockStore
    consumer: EventConsumer
    reuse_client: Any  # redis.asyncio client for the reuse counters
    metrics: ServiceMetrics
    max_lookup_blocks: int


ADMIN_PATHS = ("/metrics", "/stats", "/instances")  # on the admin listener when there is one


def build_app(state: ServiceState, lifespan: Any = None, admin_port: int | None = None) -> FastAPI:
    app = FastAPI(title="kvharbor KV cache service", version="v1", lifespan=lifespan)
    install_error_handlers(app, log, lambda path, status: state.metrics.requests.labels(path, str(status)).inc())
    # 16 MiB: a lookup of the longest chain allowed, as token ids, fits several times over.
    app.add_middleware(BodyGuardMiddleware, limit=16 << 20, prefixes=("/",))
    routes = _Routes(state)
    app.post("/lookup")(routes.lookup)
    app.get("/instances")(routes.instances)
    app.get("/stats")(routes.stats)
    app.get("/metrics")(routes.metrics)
    app.get("/health")(routes.health)
    app.get("/ready")(routes.ready)
    app.add_middleware(ListenerSplit, admin_port=admin_port, admin_paths=ADMIN_PATHS)
    return app


def _unavailable(exc: Exception) -> APIError:
    return APIError(
        503,
        f"{exc}; route by load until Redis is back",
        type="service_unavailable",
        code="index_unavailable",
        headers={"Retry-After": RETRY_AFTER_S},
    )


class _Routes:
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    async def lookup(self, body: LookupRequest) -> dict:
        state = self.state
        started = time.perf_counter()
        try:
            hashes = await self._hashes(body)
            matches = await state.index.lookup(body.model, hashes, body.instances, body.tier)
        except IndexUnavailable as exc:
            state.metrics.lookups.labels("error").inc()
            raise _unavailable(exc) from None
        state.metrics.lookup_seconds.observe(time.perf_counter() - started)
        state.metrics.lookups.labels("hit" if any(matches.values()) else "miss").inc()
        return {"model": body.model, "blocks": len(hashes), "matches": matches}

    async def _hashes(self, body: LookupRequest) -> list[bytes]:
        limit = self.state.max_lookup_blocks
        if body.block_hashes is not None:
            if len(body.block_hashes) > limit:
                raise APIError(400, f"at most {limit} block hashes per lookup", param="block_hashes")
            return [from_hex(h) for h in body.block_hashes]
        block_size = body.block_size or await self.state.index.block_size(body.model)
        if block_size is None:
            raise APIError(
                404,
                f"no engine of model {body.model!r} has published KV events yet, so its block size is unknown: "
                "pass block_size, or check the model name",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        if len(body.token_ids) // block_size > limit:
            raise APIError(400, f"at most {limit} blocks ({limit * block_size} tokens) per lookup", param="token_ids")
        return block_hashes(body.token_ids, block_size, body.model, body.cache_salt, body.adapter)

    async def instances(self) -> dict:
        try:
            infos = await self.state.index.instances()
        except IndexUnavailable as exc:
            raise _unavailable(exc) from None
        return {"instances": [info.__dict__ for info in infos]}

    async def _snapshot(self) -> dict:
        state = self.state
        intake = state.consumer.stats
        snap: dict[str, Any] = {
            "redis_up": await state.index.ping(),
            "intake": {
                "leader": intake.leader,
                "healthy": intake.healthy,
                "consumer": state.consumer.consumer,
                "members": intake.members,
                "streams": sorted(state.consumer.streams),
                "handoffs": intake.handoffs,
                "resyncs_requested": intake.resyncs_requested,
                "applied": intake.applied,
                "duplicates": intake.duplicates,
                "malformed": dict(intake.malformed),
                "claimed": intake.claimed,
                "acked": intake.acked,
                "swept": intake.swept,
                "old_layout_removed": intake.old_layout_removed,
                "errors": intake.errors,
                "last_error": intake.last_error,
            },
        }
        if not snap["redis_up"]:
            return snap
        try:
            infos, store, reuse = await asyncio.gather(
                state.index.instances(), state.store.stats(), read_all(state.reuse_client)
            )
        except (IndexUnavailable, BlockStoreUnavailable, RedisError, OSError) as exc:
            snap["error"] = str(exc)
            return snap
        snap["index"] = {
            "instances": len(infos),
            "alive": sum(i.alive for i in infos),
            "blocks": sum(i.blocks for i in infos),
        }
        snap["store"] = {**store, "refused": dict(state.store.refused)}
        snap["reuse"] = reuse
        return snap

    async def stats(self) -> dict:
        return await self._snapshot()

    async def metrics(self) -> Response:
        return Response(self.state.metrics.render(await self._snapshot()), media_type="text/plain; version=0.0.4")

    async def health(self) -> dict:
        return {"status": "ok"}

    async def ready(self) -> JSONResponse:
        redis_up = await self.state.index.ping()
        body = {
            "ready": redis_up,
            "redis": "up" if redis_up else "down",
            "intake_leader": self.state.consumer.stats.leader,
        }
        return JSONResponse(body, status_code=200 if redis_up else 503)
