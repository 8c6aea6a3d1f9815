"""POST /v1/embeddings at the gateway: the tenant's key, model grant, caps and token limits, then
an engine that serves embeddings for the model (a kvharbor engine whose /load says task embed, or
an engine of a model the models file marks `task: embed`, vLLM pods included), chosen by the
router like any prompt (the first input's blocks: a repeated document lands where it is cached),
with retries before an answer.

An embedding call takes one of the tenant's concurrency slots however many inputs it carries (one
prefill pass, no decode), and its tokens count against the tenant's TPM. Inputs go to the engine
as token ids, tokenized once here. Without any engine serving embeddings for the model, the answer
is a 404 that says how to start one.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.openai_api import APIError, EmbeddingRequest, request_id
from kvharbor.gateway.catalog import resolve
from kvharbor.gateway.engines import Engine
from kvharbor.gateway.limits import take_limits
from kvharbor.gateway.proxy import with_retries
from kvharbor.gateway.router import block_size_for
from kvharbor.gateway.tenants import Tenant, over_cap

log = logging.getLogger("kvharbor.gateway.embeddings")
HOW_TO_START = ("start one with `kvharbor up --embedding-model PATH`, an InferenceService with `task: embed`, or an "
                "engine with `kvharbor serve --task embed` listed in the models file with `task: embed`")  # fmt: skip


class EmbeddingsAPI:
    """The endpoint; `handler` is the app's front matter (gateway/app.py)."""

    def __init__(self, handler: Any) -> None:
        self.handler, self.state = handler, handler.state

    def install(self, app: Any) -> None:
        app.post("/v1/embeddings")(self.embeddings)

    def _engines(self, model: str) -> list[Engine]:
        task = self.state.models[model].task
        return [e for e in self.state.pool.routable(model) if e.kind.serves_embeddings(e, task)]

    async def embeddings(self, request: Request) -> Response:
        state, handler = self.state, self.handler
        tenant = handler._tenant(request)
        body: EmbeddingRequest = (await handler._parse(request, EmbeddingRequest)).body
        resolved = resolve(body.model, tenant, handler._engines_by_model())
        if resolved.adapter is not None:
            raise APIError(400, "embeddings run on a base model, not a LoRA adapter", param="model")
        model = state.models[resolved.base]
        engines = self._engines(model.name)
        if not engines:
            raise APIError(404, f"no engine serves embeddings of {model.name!r}: {HOW_TO_START}", param="model",
                           code="no_embedding_engine")  # fmt: skip
        prompts = self._tokenize(body, model)
        longest = max(map(len, prompts))
        asked = {"prompt_tokens": longest, "body_bytes": len(await request.body())}
        if (over := over_cap(tenant.caps, asked)) is not None:
            raise APIError(400, over[0], param="input" if over[1] == "messages" else over[1], code="tenant_cap")
        if longest > state.max_prompt_tokens:
            raise APIError(400, f"an input has {longest} tokens; this gateway accepts at most "
                           f"{state.max_prompt_tokens}", param="input", code="prompt_too_long")  # fmt: skip
        rid = request_id(body.request_id, request.headers.get("x-request-id"), "gw-embd")
        slot, tokens = uuid.uuid4().hex, sum(map(len, prompts))
        refusals = state.metrics.rejections
        headers = await take_limits(state.limiter, tenant, tokens, slot, 1,
                                    lambda reason: refusals.labels(tenant.name, reason).inc())  # fmt: skip
        try:
            content = await self._send(tenant, model, engines, prompts, body, rid)
        finally:
            await state.limiter.release(tenant, slot, 1)
        state.metrics.tokens.labels(tenant.name, "prompt").inc(tokens)
        state.metrics.requests.labels(tenant.name, model.name, "ok").inc()
        return Response(content, media_type="application/json", headers={"x-request-id": rid, **headers})

    def _tokenize(self, body: EmbeddingRequest, model: Any) -> list[list[int]]:
        out = []
        for item in body.inputs():
            if isinstance(item, str):
                if model.tokenizer is None:
                    raise APIError(400, f"model {model.name!r} has no tokenizer here: send token ids", param="input")
                out.append(model.tokenizer.encode(item))
            else:
                out.append(list(item))
        return out

    async def _send(self, tenant: Tenant, model: Any, engines: list[Engine], prompts: list[list[int]],
                    body: EmbeddingRequest, rid: str) -> bytes:  # fmt: skip
        state = self.state
        size, _ = block_size_for(model.block_size, engines)
        hashes = block_hashes(prompts[0], size, model.name, tenant.cache_salt, None)
        tokens = len(prompts[0])

        async def choose(exclude: set[str]) -> Engine | None:
            left = [e for e in engines if e.url not in exclude]
            if not left:
                return None
            route = await state.router.choose(model.name, left, hashes, tokens, size, model.slo_itl_s, None)
            return route.engine if route else None

        first = await choose(set())
        if first is None:
            raise APIError(503, "no engine could take the request; retry later", type="service_unavailable",
                           code="no_engine", headers={"Retry-After": "1"})  # fmt: skip

        async def run(engine: Engine) -> bytes:
            sent = engine.send(sum(map(len, prompts)), None, tokens)
            try:
                payload = _engine_body(engine, body, prompts, tenant, rid)
                content, _ = await state.caller.call(engine, "/v1/embeddings", payload, {"x-request-id": rid})
                return content
            finally:
                sent.done()

        return await with_retries(state.max_attempts, first, choose, run)


def _engine_body(engine: Engine, body: EmbeddingRequest, prompts: list[list[int]], tenant: Tenant, rid: str) -> dict:
    """The inputs as token ids, under the tenant's identity; a vLLM server gets none of kvharbor's fields."""
    out: dict[str, Any] = {"model": body.model, "input": prompts, "encoding_format": body.encoding_format,
                           "user": tenant.name}  # fmt: skip
    if body.dimensions is not None:
        out["dimensions"] = body.dimensions
    if engine.kind.takes_kvharbor_fields:
        unique = f"{rid[:200]}.{uuid.uuid4().hex[:8]}"
        out.update(cache_salt=tenant.cache_salt, priority=tenant.priority, request_id=unique)
    return out
