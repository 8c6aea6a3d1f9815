"""The gateway's HTTP API: the tenants' OpenAI endpoints in front of the engines.

For each request: authenticate the key, validate the body, check the model and the tenant's right
to it, tokenize once (chat template included), take the rate limits, hash the prompt's blocks under
the tenant's cache salt, wait for admission (SLO), route, and relay the engine's answer. This
module is the HTTP shell (parse, authenticate, limits, respond); gateway/flow.py takes each call
from admission to its answer, and gateway/engine_body.py shapes what an engine receives.

A `model` that names a LoRA adapter (gateway/catalog.py) runs on its base model's entry, on the
engines that serve the adapter, hashed under the adapter's identity; the engine gets the request's
`model` unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace

from kvharbor.common.admin_listener import ListenerSplit
from kvharbor.common.http_errors import BodyGuardMiddleware, install_error_handlers
from kvharbor.common.logs import request_context
from kvharbor.common.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    message_dicts,
    request_id,
)
from kvharbor.common.request_body import Parsed, document_bodies, read_body
from kvharbor.common.responses_api import ResponsesRequest
from kvharbor.gateway.call import Call, ModelEntry, count_rejected
from kvharbor.gateway.catalog import listed_models, resolve
from kvharbor.gateway.embeddings import EmbeddingsAPI
from kvharbor.gateway.engines import Engine
from kvharbor.gateway.flow import RequestFlow
from kvharbor.gateway.limits import take_limits
from kvharbor.gateway.proxy import EngineRefused
from kvharbor.gateway.responses import ResponsesAPI
from kvharbor.gateway.state import GatewayState
from kvharbor.gateway.tenants import Tenant, over_cap

log = logging.getLogger("kvharbor.gateway.api")


ADMIN_PATHS = ("/metrics",)  # on the admin listener only (common/admin_listener.py)


def build_app(state: GatewayState, lifespan: Any = None, admin_port: int | None = None) -> FastAPI:
    app = FastAPI(title="kvharbor gateway", version="v1", lifespan=lifespan)
    install_error_handlers(app, log)
    handler = _Handler(state)
    app.post("/v1/chat/completions")(handler.chat)
    app.post("/v1/completions")(handler.completions)
    ResponsesAPI(handler).install(app)
    EmbeddingsAPI(handler).install(app)
    app.get("/v1/models")(handler.models)
    app.get("/health")(handler.health)
    app.get("/ready")(handler.ready)
    app.get("/metrics")(handler.metrics)
    app.add_middleware(BodyGuardMiddleware, limit=state.max_body_bytes, prefixes=("/v1/",))
    app.add_middleware(ListenerSplit, admin_port=admin_port, admin_paths=ADMIN_PATHS)
    document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest},
                    bearer=True)  # fmt: skip
    return app


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


class _Handler:
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    # -- front matter -------------------------------------------------------------------------------

    def _tenant(self, request: Request) -> Tenant:
        tenant = self.state.tenants_fresh().authenticate(_bearer(request))
        if tenant is None:
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        return tenant

    async def _parse(self, request: Request, model_cls: type) -> Parsed:
        """The body, read once at this edge (common/request_body.py): 400 naming the field."""
        return await read_body(request, model_cls, self.state.limits, self.state.metrics.ignored_fields)

    def _engines_by_model(self) -> dict[str, list[Engine]]:
        return {m: self.state.pool.routable(m) for m in self.state.models}

    def _tokenize(self, kind: str, body: Any, model: ModelEntry) -> list[list[int]]:
        tok = model.tokenizer
        if body.prompt_token_ids is not None:
            return [list(body.prompt_token_ids)]
        if tok is None:
            raise APIError(400, f"model {model.name!r} has no tokenizer here: send prompt_token_ids", param="prompt")
        if kind == "chat":
            try:
                return [tok.encode_chat(message_dicts(body.messages), tools=body.prompt_tools())]
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]

    async def _call(self, request: Request, kind: str) -> Call:
        tenant = self._tenant(request)
        parsed = await self._parse(request, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        return await self._call_from(request, kind, tenant, parsed)

    async def _call_from(self, request: Request, kind: str, tenant: Tenant, parsed: Parsed) -> Call:
        """The call of a parsed body: its model, prompts and the tenant's caps checked (the
        Responses API makes its chat body itself, gateway/responses.py)."""
        body, raw = parsed.body, parsed.raw
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
        rid = request_id(body.request_id, request.headers.get("x-request-id"), "gw")
        return Call(kind, tenant, model, body, raw, prompts, rid, resolved, ignored=parsed.headers())

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
        return await self._run(request, await self._call(request, kind))

    async def _run(self, request: Request, call: Call) -> Response:
        """The call's answer: limits taken, sent down its flow (a stream settles when it ends)."""
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
                    response = await RequestFlow(state, call).respond(request, headers)
                    streaming = isinstance(response, StreamingResponse)
                finally:
                    if not streaming:
                        await state.limiter.release(call.tenant, call.slot, call.weight)
                return response
            except APIError as exc:
                if isinstance(exc, EngineRefused):
                    state.metrics.refused.labels(exc.reason).inc()
                span.set_attribute("http.status_code", exc.status)
                if exc.status >= 500:
                    span.set_status(trace.StatusCode.ERROR, exc.message)
                raise
            finally:
                if not streaming:
                    span.end()

    async def _take_limits(self, call: Call) -> dict[str, str]:
        tokens = sum(map(len, call.prompts))
        most = call.tenant.limits.max_concurrent
        if most and call.weight > most:  # it would wait for slots that never come
            raise APIError(
                400, f"the request carries {call.weight} prompts, each a request against tenant "
                f"{call.tenant.name!r}'s limit of {most} concurrent requests: send at most {most} at once",
                param="prompt", code="too_many_prompts",
            )  # fmt: skip
        headers = await take_limits(self.state.limiter, call.tenant, tokens, call.slot, call.weight,
                                    lambda reason: count_rejected(self.state.metrics, call, reason))  # fmt: skip
        self.state.metrics.tokens.labels(call.tenant.name, "prompt").inc(tokens)
        self.state.metrics.adapter_tokens.labels(call.model.name, call.adapter_label, "prompt").inc(tokens)
        return headers
