"""GatewayState: everything the gateway's request path shares (models, tenants, limits, engines,
router, admission, the engine caller, metrics, the response store), built once by
gateway/service.py and read by the HTTP shell (app.py) and each call's flow (flow.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvharbor.common.request_limits import RequestLimits
from kvharbor.gateway.admission import AdmissionQueue
from kvharbor.gateway.call import ModelEntry
from kvharbor.gateway.engines import EnginePool
from kvharbor.gateway.limits import RateLimiter
from kvharbor.gateway.metrics import GatewayMetrics
from kvharbor.gateway.proxy import EngineCaller
from kvharbor.gateway.response_store import MemoryResponseStore
from kvharbor.gateway.router import Router
from kvharbor.gateway.tenants import TenantRegistry


@dataclass
class GatewayState:
    models: dict[str, ModelEntry]
    tenants: TenantRegistry
    limiter: RateLimiter
    pool: EnginePool
    router: Router
    admission: AdmissionQueue
    caller: EngineCaller
    metrics: GatewayMetrics
    tracer: Any
    max_attempts: int
    max_prompt_tokens: int
    max_body_bytes: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    stream_deadline: float = 1800.0  # seconds a streamed answer may run (ResilienceConfig)
    stream_idle: float = 60.0  # seconds a stream may go without a token
    max_migrations: int = 2  # times one stream may move to another engine when its engine fails
    index: Any = None
    # The Responses API's store (gateway/response_store.py); service.build_state picks Redis's.
    responses: Any = field(default_factory=lambda: MemoryResponseStore(2_592_000.0, 64 * 2**20))
    responses_ttl: float = 2_592_000.0
    discovery: Any = None  # KubernetesDiscovery, followed by a lifespan task; None for static engines
    discovery_interval: float = 5.0
    _tenants_checked: float = field(default=0.0)

    def tenants_fresh(self) -> TenantRegistry:
        now = time.monotonic()
        if now - self._tenants_checked > 1.0:  # a stat() per second, not per request
            self._tenants_checked = now
            self.tenants.refresh()
        return self.tenants
