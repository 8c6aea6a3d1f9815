"""The gateway's HTTP API: the tenants' OpenAI endpoints in front of the engines.

For each request: authenticate the key, validate the body, check the model and the tenant's right
to it, tokenize once (chat template included), take the rate limits, hash the prompt's blocks under
the tenant's cache salt, wait for admission (SLO), route, and relay the engine's answer. The
engine gets `prompt_token_ids`, `cache_salt`, `priority`, `request_id` and, when another engine
holds more of the prefix, `kv_prefix_source=shared`.

A `model` that names a LoRA adapter (gateway/catalog.py) runs on its base model's entry, on the
engines that serve the adapter, hashed under the adapter's identity; the engine gets the request's
`model` unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from pydantic import ValidationError

from kvharbor.common.admin_listener import ListenerSplit
from kvharbor.common.block_hash import DEFAULT_BLOCK_SIZE, block_hashes
from kvharbor.common.http_errors import BodyGuardMiddleware, install_error_handlers
from kvharbor.common.logs import request_context
from kvharbor.common.openai_api import APIError, ChatCompletionRequest, CompletionRequest, message_dicts
from kvharbor.common.sampling_limits import MAX_CONTINUED_TEXT
from kvharbor.common.tokenizer import Tokenizer
from kvharbor.common.tracing import inject
from kvharbor.gateway.admission import AdmissionQueue, QueueTimeout, Shed, fit_route
from kvharbor.gateway.catalog import Resolved, adapter_engines, handoff_peers, listed_models, resolve
from kvharbor.gateway.disagg import Decision, decide, decode_candidates, prefill_pool
from kvharbor.gateway.disagg import Request as PDRequest
from kvharbor.gateway.engines import Engine, EnginePool, Sent
from kvharbor.gateway.limits import LimiterUnavailable, RateLimiter
from kvharbor.gateway.metrics import GatewayMetrics, adapter_label
from kvharbor.gateway.predict import adapter_slot, uncached_tokens
from kvharbor.gateway.proxy import EngineCaller, EngineFailed, with_retries
from kvharbor.gateway.relay import Continuation, EngineStream, StreamRelay, StreamStats
from kvharbor.gateway.router import Route, Router, block_size_for
from kvharbor.gateway.tenants import Tenant, TenantRegistry, over_cap

log = logging.getLogger("kvharbor.gateway.api")

# What only the gateway puts on a request to an engine; a tenant's own value never reaches one.
# cache_salt and priority come from the tenant's record (a salt of the tenant's choosing would read
# other tenants' cache); request_id is made unique per attempt (the client's stays in the logs
# and x-request-id); kv_prefix_source and kv_transfer_params make an engine pull KV from elsewhere
# or connect out, so only the router may set them.
# continued_text opens an engine's output with text of the gateway's choosing (a migrated stream's),
# and text_offset places it in the client's text.
GATEWAY_FIELDS = (
    "cache_salt", "priority", "request_id", "kv_prefix_source", "kv_transfer_params", "continued_text", "text_offset",
)  # fmt: skip


@dataclass
class ModelEntry:
    name: str
    tokenizer: Tokenizer | None
    slo_ttft_s: float
    slo_itl_s: float
    block_size: int | None = None  # pinned by the models file; None: the engines' (router.block_size_for)
    mismatch: str | None = None  # the block-size disagreement last logged, if any


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
    stream_deadline: float = 1800.0  # seconds a streamed answer may run (ResilienceConfig)
    stream_idle: float = 60.0  # seconds a stream may go without a token
    max_migrations: int = 2  # times one stream may move to another engine when its engine fails
    index: Any = None
    discovery: Any = None  # KubernetesDiscovery, followed by a lifespan task; None for static engines
    discovery_interval: float = 5.0
    _tenants_checked: float = field(default=0.0)

    def tenants_fresh(self) -> TenantRegistry:
        now = time.monotonic()
        if now - self._tenants_checked > 1.0:  # a stat() per second, not per request
            self._tenants_checked = now
            self.tenants.refresh()
        return self.tenants


ADMIN_PATHS = ("/metrics",)  # on the admin listener only (common/admin_listener.py)
# A P/D prefill's deadline, in predicted TTFTs (at least --pd-prefill-deadline-s): past it the
# prefill engine counts as stalled. Predictions from EWMAs of a busy engine can be off by 2x.
PREFILL_DEADLINE_X_TTFT = 4.0
# With no measured prefill rate (a fresh or restarted engine predicts a TTFT of 0), the deadline
# allows the prompt at this many tokens a second: a slow CPU engine, so that a long first prompt is
# not taken for a stall.
UNMEASURED_PREFILL_TOKENS_PER_S = 100.0


def prefill_deadline(floor_s: float, predicted_ttft_s: float, prompt_tokens: int) -> float:
    """Seconds a P/D prefill engine gets before it counts as stalled."""
    if predicted_ttft_s > 0:
        return max(floor_s, PREFILL_DEADLINE_X_TTFT * predicted_ttft_s)
    return max(floor_s, prompt_tokens / UNMEASURED_PREFILL_TOKENS_PER_S)


class PrefillStalled(Exception):
    """A P/D prefill engine did not answer within its deadline."""


def build_app(state: GatewayState, lifespan: Any = None, admin_port: int | None = None) -> FastAPI:
    app = FastAPI(title="kvharbor gateway", version="v1", lifespan=lifespan)
    install_error_handlers(app, log)
    handler = _Handler(state)
    app.post("/v1/chat/completions")(handler.chat)
    app.post("/v1/completions")(handler.completions)
    app.get("/v1/models")(handler.models)
    app.get("/health")(handler.health)
    app.get("/ready")(handler.ready)
    app.get("/metrics")(handler.metrics)
    app.add_middleware(BodyGuardMiddleware, limit=state.max_body_bytes, prefixes=("/v1/",))
    app.add_middleware(ListenerSplit, admin_port=admin_port, admin_paths=ADMIN_PATHS)
    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Bodies are parsed by hand (the API key is checked before the body), so put their schemas
    into the OpenAPI document explicitly: clients and fuzzers see what the endpoints take."""
    bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = default()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(
            401,
            "missing API key: send the header 'Authorization: Bearer <your key>'",
            type="authentication_error",
            code="missing_api_key",
        )
    return key.strip()


@dataclass
class _Call:
    """One request on its way through the gateway."""

    kind: str  # chat | completion
    tenant: Tenant
    model: ModelEntry
    body: ChatCompletionRequest | CompletionRequest
    raw: dict
    prompts: list[list[int]]
    rid: str
    resolved: Resolved  # its base model and LoRA adapter
    arrival: float = field(default_factory=time.monotonic)
    slot: str = field(default_factory=lambda: uuid.uuid4().hex)  # this admission's concurrency slot
    span: Any = None
    block_size: int = DEFAULT_BLOCK_SIZE  # what its prompt's blocks are cut by (set on admission)
    hashes: list[bytes] = field(default_factory=list)  # its prompt's block hashes (set on admission)
    transfer: dict | None = None  # P/D: the prefill engine's hand-off, for the decode engine

    @property
    def adapter(self) -> str | None:
        """Its LoRA adapter's name; None for the base model."""
        return self.resolved.adapter

    @property
    def adapter_label(self) -> str:
        return adapter_label(self.resolved.adapter)

    @property
    def pd_supported(self) -> bool:
        """P/D carries one prompt, one sample and no logprobs."""
        body = self.body
        return len(self.prompts) == 1 and (body.n or 1) == 1 and body.num_logprobs() is None

    @property
    def engine_rid(self) -> str:
        """Unique at the engine even when clients reuse ids (theirs stays in x-request-id and logs)."""
        return f"{self.rid}.{self.slot[:8]}"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


class _Handler:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    # -- front matter -------------------------------------------------------------------------------

    def _tenant(self, request: Request) -> Tenant:
        tenant = self.state.tenants_fresh().authenticate(_bearer(request))
        if tenant is None:
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return tenant

    async def _parse(self, request: Request, model_cls: type) -> tuple[Any, dict]:
        try:
            raw = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model_cls.model_validate(raw), raw
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(
                400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")), param=where or None
            ) from None

    def _engines_by_model(self) -> dict[str, list[Engine]]:
        return {m: self.state.pool.routable(m) for m in self.state.models}

    def _candidates(self, call: _Call, exclude: Collection[str] = ()) -> list[Engine]:
        """The routable engines that may take the whole request: of its base model, serving its
        adapter, not prefill-only (unless nothing else runs), not in `exclude` (urls)."""
        engines = adapter_engines(self.state.pool.routable(call.model.name), call.adapter)
        return [e for e in decode_candidates(engines) if e.url not in exclude]

    async def _choose(self, call: _Call, engines: list[Engine]):
        """The router's route for `call` among `engines` (its candidates), or None when there is
        none (no engine, or the router declines)."""
        if not engines:
            return None
        model = call.model
        return await self.state.router.choose(
            model.name, engines, call.hashes, len(call.prompts[0]), call.block_size, model.slo_itl_s, call.adapter
        )

    def _tokenize(self, kind: str, body: Any, model: ModelEntry) -> list[list[int]]:
        tok = model.tokenizer
        if body.prompt_token_ids is not None:
            return [list(body.prompt_token_ids)]
        if tok is None:
            raise APIError(400, f"model {model.name!r} has no tokenizer here: send prompt_token_ids", param="prompt")
        if kind == "chat":
            try:
                return [tok.encode_chat(message_dicts(body.messages))]
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    async def _call(self, request: Request, kind: str) -> _Call:
        tenant = self._tenant(request)
        body, raw = await self._parse(request, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        resolved = resolve(body.model, tenant, self._engines_by_model())
        model = self.state.models[resolved.base]
        prompts = self._tokenize(kind, body, model)
        longest = max(map(len, prompts))
        caps = tenant.caps
        asked = {"max_tokens": body.max_new_tokens(), "n": body.n, "prompt_tokens": longest,
                 "body_bytes": len(await request.body())}  # fmt: skip
        if (over := over_cap(caps, asked)) is not None:
            raise APIError(400, over[0], param=over[1], code="tenant_cap")
        if caps.max_tokens is not None and body.max_new_tokens() is None:
            raw["max_tokens"] = caps.max_tokens  # unbounded by the client: bounded by the tenant's cap
        if longest > self.state.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {longest} tokens; this gateway accepts at most {self.state.max_prompt_tokens}",
                param="messages" if kind == "chat" else "prompt",
                code="prompt_too_long",
            )
        if longest == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        rid = body.request_id or request.headers.get("x-request-id") or f"gw-{uuid.uuid4().hex}"
        if not (rid.isascii() and rid.isprintable()) or len(rid) > 256:  # it goes on as a header
            raise APIError(400, "request id must be printable and at most 256 characters", param="request_id")
        return _Call(kind, tenant, model, body, raw, prompts, rid, resolved)

    # -- endpoints ------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def models(self, request: Request) -> dict:
        tenant = self._tenant(request)
        return {"object": "list", "data": listed_models(tenant, self._engines_by_model())}

    async def health(self) -> dict:
        return {"status": "ok"}

    async def ready(self) -> JSONResponse:
        up = {m: len(self.state.pool.routable(m)) for m in self.state.models}
        ok = all(up.values())
        return JSONResponse({"ready": ok, "engines": up}, status_code=200 if ok else 503)

    async def metrics(self) -> Response:
        m = self.state.metrics
        for model in self.state.models:
            m.engines_up.labels(model).set(len(self.state.pool.routable(model)))
        m.queued.set(self.state.admission.size)
        return Response(m.render(list(self.state.models)), media_type="text/plain; version=0.0.4")

    # -- the request path -------------------------------------------------------------------------------

    async def _serve(self, request: Request, kind: str) -> Response:
        call = await self._call(request, kind)
        state = self.state
        # The span outlives the handler for streams: the relay's settle ends it when the stream does.
        span = call.span = state.tracer.start_span(f"gateway {call.path}")
        span.set_attribute("kvharbor.tenant", call.tenant.name)
        span.set_attribute("kvharbor.model", call.model.name)
        if call.adapter:
            span.set_attribute("kvharbor.adapter", call.adapter)
        span.set_attribute("kvharbor.request_id", call.rid)
        streaming = False
        with request_context(call.rid), trace.use_span(span, end_on_exit=False):
            try:
                headers = await self._take_limits(call)
                try:
                    route = await self._admit(call)
                    response = await self._forward(call, route, headers, request)
                    streaming = isinstance(response, StreamingResponse)
                finally:
                    if not streaming:
                        await state.limiter.release(call.tenant, call.slot)
                return response
            except APIError as exc:
                span.set_attribute("http.status_code", exc.status)
                if exc.status >= 500:
                    span.set_status(trace.StatusCode.ERROR, exc.message)
                raise
            finally:
                if not streaming:
                    span.end()

    async def _take_limits(self, call: _Call) -> dict[str, str]:
        tokens = sum(map(len, call.prompts))
        try:
            decision = await self.state.limiter.admit(call.tenant, tokens, call.slot)
        except LimiterUnavailable as exc:
            self._reject(call, "limiter_unavailable")
            raise APIError(
                503, str(exc), type="service_unavailable", code="limiter_unavailable", headers={"Retry-After": "1"}
            ) from None
        if not decision.ok:
            self._reject(call, decision.reason)
            retry = str(max(1, math.ceil(decision.retry_after_s)))
            raise APIError(
                429,
                f"rate limit reached for tenant {call.tenant.name!r} ({decision.reason}); retry after {retry}s",
                type="rate_limit_error",
                code=f"rate_limit_{decision.reason}",
                headers={**decision.headers, "Retry-After": retry},
            )
        self.state.metrics.tokens.labels(call.tenant.name, "prompt").inc(tokens)
        self.state.metrics.adapter_tokens.labels(call.model.name, call.adapter_label, "prompt").inc(tokens)
        return decision.headers

    def _reject(self, call: _Call, reason: str) -> None:
        self.state.metrics.rejections.labels(call.tenant.name, reason).inc()
        self.state.metrics.requests.labels(call.tenant.name, call.model.name, "rejected").inc()
        self.state.metrics.adapter_requests.labels(call.model.name, call.adapter_label, "rejected").inc()
        log.info("rejected", extra={"tenant": call.tenant.name, "reason": reason})

    def _hashes(self, call: _Call) -> list[bytes]:
        """Under the base model, the tenant's salt and the adapter's identity (not its name): what
        the engines publish, so the KV index lookups match (common/block_hash.py)."""
        return block_hashes(
            call.prompts[0], call.block_size, call.model.name, call.tenant.cache_salt, call.resolved.identity
        )

    def _block_size(self, model: ModelEntry) -> int:
        """The engines' block size (a mismatch is logged when it starts, and counted per request)."""
        size, mismatch = block_size_for(model.block_size, self.state.pool.all(model.name))
        if mismatch:
            self.state.metrics.block_size_mismatches.labels(model.name).inc()
            if mismatch != model.mismatch:
                log.error("KV block size mismatch: prefix lookups on the other size miss", extra={
                    "model": model.name, "problem": mismatch})  # fmt: skip
        model.mismatch = mismatch
        return size

    async def _admit(self, call: _Call) -> Route:
        state = self.state
        call.block_size = self._block_size(call.model)
        call.hashes = self._hashes(call)  # once: retries and the P/D decision reuse them
        model = call.model

        async def try_now() -> Route | None:
            engines = self._candidates(call)
            route = await self._choose(call, engines)
            if route is None:
                return None
            prompt = len(call.prompts[0])
            return fit_route(
                route, engines, prompt, call.block_size, model.slo_ttft_s, call.adapter, slo_itl_s=model.slo_itl_s
            )

        try:
            route, queued = await state.admission.admit(
                call.tenant.name, call.tenant.priority, call.tenant.sheddable, try_now
            )
        except Shed as exc:
            self._reject(call, "shed_" + exc.reason)
            raise APIError(
                503,
                "the service is over its latency target and sheds low-priority requests; retry later"
                if exc.reason == "slo"
                else "the admission queue is full; retry later",
                type="service_unavailable",
                code=f"shed_{exc.reason}",
                headers={"Retry-After": "2"},
            ) from None
        except QueueTimeout:
            self._reject(call, "queue_timeout")
            raise APIError(
                503,
                f"no engine could take the request within {state.admission.timeout:.0f}s; retry later",
                type="service_unavailable",
                code="queue_timeout",
                headers={"Retry-After": "5"},
            ) from None
        state.metrics.queue_seconds.labels(call.tenant.name).observe(queued)
        return route

    def _count_route(self, call: _Call, route: Route) -> None:
        """The route the request takes, once P/D has had its say (a short output served whole by a
        prefill engine counts there, as short_output), before it is sent: the adapter slot is the
        one it finds."""
        m, model = self.state.metrics, call.model.name
        m.routes.labels(model, route.reason).inc()
        m.prompt_blocks.labels(model).inc(route.prompt_blocks)
        m.matched_blocks.labels(model).inc(route.matched_blocks)
        if call.adapter:
            m.adapter_routes.labels(model, call.adapter, adapter_slot(route.engine, call.adapter).value).inc()

    def _payload(self, call: _Call, route: Route, engine: Engine) -> dict:
        payload = {
            **{k: v for k, v in call.raw.items() if k not in GATEWAY_FIELDS},
            "cache_salt": call.tenant.cache_salt,
            "priority": call.tenant.priority,
            "request_id": call.engine_rid,
            "user": call.tenant.name,
        }
        if len(call.prompts) == 1:
            payload["prompt_token_ids"] = call.prompts[0]
            payload.pop("prompt", None)
        else:
            payload["prompt"] = call.prompts
        if call.transfer is not None:
            payload["kv_transfer_params"] = call.transfer
        elif source := route.kv_prefix_source(engine):
            payload["kv_prefix_source"] = source
        if call.body.stream:
            payload["stream_options"] = {"include_usage": True}  # the gateway counts tokens
            if self.state.max_migrations and len(call.prompts) == 1 and (call.body.n or 1) == 1:
                payload["return_token_ids"] = True  # what a migration continues from
        return payload

    async def _forward(self, call: _Call, route: Route, limit_headers: dict[str, str], request: Request) -> Response:
        state = self.state
        headers = inject({"x-request-id": call.rid})

        async def pick_next(tried: set[str]) -> Engine | None:
            state.metrics.retries.labels(call.model.name).inc()
            nxt = await self._choose(call, self._candidates(call, exclude=tried))
            return nxt.engine if nxt else None

        try:
            route = await self._disaggregate(call, route, headers)
        except asyncio.CancelledError:
            self._count_route(call, route)  # cancelled while a prefill engine ran its prefill: it was routed
            raise
        self._count_route(call, route)
        first = route.engine

        prompt = len(call.prompts[0])

        def uncached(engine: Engine) -> int:
            if call.transfer is not None:
                return prompt % call.block_size  # the hand-off brings every full block
            return uncached_tokens(prompt, route.held.get(engine.url, 0), call.block_size)

        if not call.body.stream:

            async def run(engine: Engine) -> tuple[bytes, dict]:
                sent = engine.send(uncached(engine), call.adapter, prompt)
                try:
                    return await state.caller.call(engine, call.path, self._payload(call, route, engine), headers)
                finally:
                    sent.done()

            content, usage = await _unless_disconnected(
                request, with_retries(state.max_attempts, first, pick_next, run)
            )
            self._finished(call, usage, None)
            # The engine's bytes as they came: parsing and re-encoding would only add latency.
            headers_out = {"x-request-id": call.rid, **limit_headers}
            return Response(content, media_type="application/json", headers=headers_out)

        on = _OnEngine()

        async def open_stream(engine: Engine, payload: dict | None = None) -> EngineStream:
            sent = engine.send(uncached(engine), call.adapter, prompt)
            try:
                body = payload if payload is not None else self._payload(call, route, engine)
                stream = await state.caller.open_stream(engine, call.path, body, headers)
            except BaseException:
                sent.done()
                raise
            sent.first_token()
            on.engine, on.sent = engine, sent
            return stream

        stream = await with_retries(state.max_attempts, first, pick_next, open_stream)

        async def debit(tokens: int) -> None:
            await state.limiter.debit_tokens(call.tenant, tokens)

        async def settle(stats: StreamStats) -> None:
            on.sent.done()
            if stats.timeout is not None:
                state.metrics.stream_timeouts.labels(call.model.name, stats.timeout).inc()
            if stats.migrations:
                state.metrics.stream_migrations.labels(call.model.name, "moved").inc(stats.migrations)
            if stats.migration_failed:
                state.metrics.stream_migrations.labels(call.model.name, "failed").inc()
            if stats.finished_here:
                state.metrics.stream_migrations.labels(call.model.name, "finished").inc()
            await state.limiter.release(call.tenant, call.slot)
            self._finished(call, stats.usage, stats)
            if call.span is not None:
                call.span.end()

        async def renew() -> None:
            await state.limiter.renew_slot(call.tenant, call.slot)

        relay = StreamRelay(
            stream, call.rid, call.body.include_usage, debit, settle, deadline_s=state.stream_deadline,
            idle_s=state.stream_idle, renew=renew, renew_every_s=state.limiter.slot_ttl / 3,
            continuation=self._continuation(call, route, on, open_stream),
        )  # fmt: skip
        return _GuardedStream(
            relay.lines(),
            relay.close,
            media_type="text/event-stream",
            headers={"x-request-id": call.rid, "Cache-Control": "no-cache", **limit_headers},
        )

    def _continuation(self, call: _Call, route: Route, on: _OnEngine, open_stream) -> Continuation | None:
        """How this stream goes on if its engine fails mid-way: one prompt, one sample (the prompt
        plus the tokens streamed so far is one sequence), and migrations allowed."""
        state = self.state
        if state.max_migrations == 0 or len(call.prompts) != 1 or (call.body.n or 1) != 1:
            return None
        limit = call.body.max_new_tokens() or call.raw.get("max_tokens")
        moves = 0

        async def resume(streamed: list[int], failure: str, delivered: str) -> EngineStream:
            nonlocal moves
            moves += 1
            failed = on.engine
            on.sent.done()
            state.pool.failed(failed, f"failed mid-stream ({failure})", hard=failure == "hard")
            chosen = await self._choose(call, self._candidates(call, exclude={failed.url}))
            if chosen is None:
                raise EngineFailed("no other engine to continue the stream on")
            payload = self._payload(call, route, chosen.engine)
            payload = continued_payload(payload, call, streamed, limit, moves, delivered)
            try:
                return await open_stream(chosen.engine, payload)
            except EngineFailed as exc:
                if exc.blame is not None:
                    exc.blame()  # the stream ran elsewhere until now: this engine is at fault
                raise

        return Continuation(resume, state.max_migrations, limit, len(call.prompts[0]), not call.body.return_token_ids)

    async def _disaggregate(self, call: _Call, route: Route, headers: dict[str, str]) -> Route:
        """P/D: decide, and when a prefill engine is worth it, run the prefill there (DESIGN §9).
        A prefill that fails leaves the request colocated, counted as prefill_failed (or
        prefill_timeout, past its deadline: _prefill). Returns the
        route the request takes: the routed one, or one to the prefill engine that serves a short
        output whole (with what that engine holds of the prompt, and its KV format)."""
        state, model = self.state, call.model
        decision, held = await self._pd_decision(call, route)
        tried = decision.prefill
        if decision.disaggregated:
            floor = state.router.config.pd_prefill_deadline_s
            deadline = prefill_deadline(floor, decision.ttft_s, len(call.prompts[0]))
            failure = "prefill_failed"
            try:
                call.transfer = await self._prefill(call, route, decision.prefill, headers, deadline)
            except PrefillStalled:
                call.transfer, failure = None, "prefill_timeout"
            except asyncio.CancelledError:  # decided, then cancelled (_forward counts its route too)
                state.metrics.pd_decisions.labels(model.name, decision.reason).inc()
                raise
            if call.transfer is None:
                decision = Decision(None, failure)
        state.metrics.pd_decisions.labels(model.name, decision.reason).inc()
        # Why each request's prefill ran where it did, where there was a choice to make.
        if decision.reason not in ("off", "no_prefill_engine", "unsupported"):
            log.info("P/D decision", extra={
                "reason": decision.reason, "prompt_tokens": len(call.prompts[0]), "decode": route.engine.url,
                "prefill": (decision.whole or tried or route.engine).url,
                "gain_ms": _ms(decision.gain_s), "ttft_ms": _ms(decision.ttft_s),
                "transfer_ms": _ms(decision.transfer_s)})  # fmt: skip
        if call.span is not None:
            call.span.set_attribute("kvharbor.pd", decision.reason)
        if decision.whole is None:
            return route
        formats = {**route.kv_formats, decision.whole.url: decision.whole.load.kv_format}
        return replace(route, held=held, kv_formats=formats).to(decision.whole, "short_output")

    async def _pd_decision(self, call: _Call, route: Route) -> tuple[Decision, dict[str, int]]:
        """The decision, and the blocks of the prompt each engine holds (the prefill pool's too)."""
        state = self.state
        if state.router.config.disaggregation == "off":
            return Decision(None, "off"), route.held
        everyone = handoff_peers(state.pool.all(call.model.name), route.engine, call.adapter)
        pool = prefill_pool([e for e in everyone if e.routable])
        held = dict(route.held)
        if pool and call.pd_supported:  # what the prefill engines hold: their misses cost there
            found = await state.router.matches(call.model.name, call.hashes, pool) or {}
            held.update({e.url: found.get(e.instance_id or "", 0) for e in pool})
        request = PDRequest(len(call.prompts[0]), held, call.block_size, call.model.slo_ttft_s, call.pd_supported,
                            call.body.max_new_tokens())  # fmt: skip
        configured = any(e.role == "prefill" for e in everyone)
        config = state.router.config
        return decide(route.engine, pool, request, config.pd_min_gain_ms / 1000, configured,
                      config.pd_transfer_trust_s), held  # fmt: skip

    async def _prefill(
        self, call: _Call, route: Route, engine: Engine, headers: dict[str, str], deadline: float
    ) -> dict | None:
        """The prompt's prefill on `engine`, kept there for the decode engine: its hand-off, or None
        when the engine fails it. Raises PrefillStalled, counting a failure against the engine (as
        a stream that never starts does; enough of them, or failed /load polls, eject it), when it
        has not answered within `deadline` seconds: a stopped or wedged process accepts the
        connection and never answers, and the request waited for the whole request timeout."""
        state = self.state
        payload = {**self._payload(call, route, engine), "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        payload.pop("stream_options", None)
        payload.pop("kv_prefix_source", None)
        prompt = len(call.prompts[0])
        sent = engine.send(uncached_tokens(prompt, 0, call.block_size), call.adapter, prompt)
        stalled = False
        with state.tracer.start_as_current_span("gateway prefill") as span:
            span.set_attribute("kvharbor.engine", engine.url)
            try:
                content, _ = await asyncio.wait_for(
                    state.caller.call(engine, call.path, payload, inject(dict(headers))), deadline
                )
                transfer = json.loads(content)["kv_transfer_params"]
            except TimeoutError:
                state.pool.failed(engine, "prefill deadline")
                log.warning("prefill engine stalled past its deadline; prefilling on the decode engine", extra={
                    "engine": engine.url, "deadline_s": round(deadline, 3)})  # fmt: skip
                span.set_status(trace.StatusCode.ERROR, "prefill deadline")
                stalled = True
            except (APIError, EngineFailed, ValueError, KeyError, TypeError) as exc:
                if isinstance(exc, EngineFailed) and exc.blame is not None:
                    exc.blame()  # the request goes on colocated: a prefill engine that fails it is at fault
                log.warning("prefill engine failed; prefilling on the decode engine", extra={
                    "engine": engine.url, "error": str(exc)[:300]})  # fmt: skip
                span.set_status(trace.StatusCode.ERROR, str(exc)[:300])
                return None
            finally:
                sent.done()
        if stalled:  # raised outside the span, which keeps the status set above
            raise PrefillStalled(engine.url)
        # The engine names itself as it was asked; the gateway knows the address it reached.
        transfer["remote_host"] = urlsplit(engine.url).hostname or transfer.get("remote_host")
        return transfer

    def _finished(self, call: _Call, usage: dict, stats: StreamStats | None) -> None:
        m = self.state.metrics
        tenant, model, adapter = call.tenant.name, call.model.name, call.adapter_label
        completion = int(usage.get("completion_tokens", 0))
        m.tokens.labels(tenant, "completion").inc(completion)
        m.adapter_tokens.labels(model, adapter, "completion").inc(completion)
        error = stats.error if stats else None
        m.requests.labels(tenant, model, "error" if error else "ok").inc()
        m.adapter_requests.labels(model, adapter, "error" if error else "ok").inc()
        now = time.monotonic()
        if stats is not None and stats.first_token is not None:
            ttft = stats.first_token - call.arrival
            m.ttft.labels(tenant).observe(ttft)
            m.adapter_ttft.labels(model, adapter).observe(ttft)
            gaps = [b - a for a, b in zip([stats.first_token, *stats.chunk_times], stats.chunk_times, strict=False)]
            adapter_itl = m.adapter_itl.labels(model, adapter)
            for gap in gaps:
                m.itl.labels(tenant).observe(gap)
                adapter_itl.observe(gap)
            itl_p95 = sorted(gaps)[int(0.95 * (len(gaps) - 1))] if gaps else 0.0
            good = ttft <= call.model.slo_ttft_s and itl_p95 <= call.model.slo_itl_s and not error
        else:
            good = stats is None and (now - call.arrival) <= call.model.slo_ttft_s + completion * call.model.slo_itl_s
        if good:
            m.goodput.labels(tenant, model).inc()
        log.info(
            "finished",
            extra={
                "tenant": tenant,
                "model": model,
                "adapter": call.adapter,
                "completion_tokens": completion,
                "e2e_ms": round((now - call.arrival) * 1000, 1),
                "error": error,
            },
        )


def _ms(seconds: float) -> float | None:
    """Milliseconds for a log field; None for an unknown (infinite) time, which JSON cannot hold."""
    return round(seconds * 1000, 1) if math.isfinite(seconds) else None


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it (and so its engine call: the engine aborts) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


@dataclass
class _OnEngine:
    """The engine a stream is on now, and its in-flight accounting (a migration moves both)."""

    engine: Engine | None = None
    sent: Sent | None = None


def continued_payload(
    payload: dict, call: _Call, streamed: list[int], limit: int | None, moves: int, delivered: str | None = None
) -> dict:
    """The request that continues a broken stream: its prompt plus the tokens already streamed,
    as one already-tokenized prompt (no chat template again), with what is left to generate.
    Sampling settings stay the same, the seed included: a seeded stream stays a valid sample of
    the model given what was streamed, not the tokens an unbroken run would have drawn. With
    `delivered` (the text the client has), the text the failed engine held back opens the new
    output (`continued_text`), so a stop string that straddles the break is still found."""
    payload = {**payload, "prompt_token_ids": [*call.prompts[0], *streamed], "return_token_ids": True}
    payload.pop("prompt", None)
    payload.pop("kv_transfer_params", None)  # a P/D hand-off is used once; this prefill is new
    if call.kind == "completion":
        payload["echo"] = False  # the client has the prompt's echo already
        if delivered is not None:  # logprobs' text_offset goes on from the text the client has
            payload["text_offset"] = len(delivered)
    if limit is not None:
        payload.pop("max_completion_tokens", None)
        payload["max_tokens"] = limit - len(streamed)
    if payload.get("min_tokens"):
        payload["min_tokens"] = max(0, int(payload["min_tokens"]) - len(streamed))
    payload["request_id"] = f"{call.engine_rid}.m{moves}"
    held = held_text(call, streamed, delivered) if delivered is not None else ""
    if held:
        payload["continued_text"] = held
    return payload


def held_text(call: _Call, streamed: list[int], delivered: str) -> str:
    """The text of `streamed` the client has not had: what the failed engine held back because
    it could start a stop string. "" without stop strings, without a tokenizer, or when the
    decoded tokens do not extend what was delivered (then the break is as before)."""
    body, tokenizer = call.body, call.model.tokenizer
    if not body.stop or tokenizer is None or not streamed:
        return ""
    # A last token that ends mid-character decodes to U+FFFD here; its bytes are completed by the
    # next engine's tokens, so the replacement character is not text to hand out.
    full = tokenizer.decode(streamed, skip_special_tokens=body.skip_special_tokens).rstrip("\ufffd")
    if not full.startswith(delivered) or len(full) - len(delivered) > MAX_CONTINUED_TEXT:
        return ""
    return full[len(delivered) :]


class _GuardedStream(StreamingResponse):
    """A StreamingResponse that settles its request even when the body never starts (a client
    gone before the first byte): Starlette would otherwise drop the generator unrun."""

    def __init__(self, content: AsyncIterator[str], settle: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._settle = settle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._settle()
