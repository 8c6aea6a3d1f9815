"""The gateway's state built in-process, for tests that drive its app without processes (over
httpx's ASGI transport, in front of fake engines or real ones): one builder, so a new field of
GatewayState is set in one place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
from opentelemetry import trace

from kvharbor.common.load_report import LoadReport
from kvharbor.gateway.admission import AdmissionQueue
from kvharbor.gateway.call import ModelEntry
from kvharbor.gateway.config import RoutingConfig
from kvharbor.gateway.engines import EnginePool
from kvharbor.gateway.limits import RateLimiter
from kvharbor.gateway.metrics import GatewayMetrics
from kvharbor.gateway.proxy import EngineCaller
from kvharbor.gateway.router import Router
from kvharbor.gateway.state import GatewayState
from kvharbor.gateway.tenants import TenantRegistry, parse_tenants


def polled_pool(
    http: httpx.AsyncClient, model: str, urls: list[str], load_of: Callable[[str], dict] = lambda url: {}
) -> EnginePool:
    """A pool of `urls` for `model`, each already polled: its instance id is its URL's last
    letter, upper-cased, and `load_of(url)` gives the rest of its LoadReport."""
    pool = EnginePool(http)
    pool.set_engines(model, urls)
    for e in pool.all(model):
        e.load = LoadReport(model=model, instance_id=e.url[-1].upper(), **load_of(e.url))
        e.instance_id, e.polled = e.load.instance_id, True
    return pool


def gateway_state(
    http: httpx.AsyncClient,
    pool: EnginePool,
    models: dict[str, Any],
    tenants: dict,
    index: Any = None,
    max_body_bytes: int = 100_000,
    routing: RoutingConfig | None = None,
) -> GatewayState:
    """A gateway with no Redis (limits in memory), 2 attempts, a 1,000-token prompt cap and short
    timeouts; `models`: name -> tokenizer (or None for one that hashes token ids as given)."""
    return GatewayState(
        models={name: ModelEntry(name, tok, 2.0, 0.2) for name, tok in models.items()},
        tenants=TenantRegistry(None, parse_tenants(tenants)),
        limiter=RateLimiter(None),
        pool=pool,
        router=Router(routing or RoutingConfig(), index),
        admission=AdmissionQueue(8, 1.0),
        caller=EngineCaller(http, pool, 1.0, 5.0, 10.0),
        metrics=GatewayMetrics(),
        tracer=trace.get_tracer("tests"),
        max_attempts=2,
        max_prompt_tokens=1000,
        max_body_bytes=max_body_bytes,
    )
