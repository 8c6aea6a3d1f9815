"""POST /v1/embeddings on an engine whose task is embed (engine/pooling.py): each input is one
pooling request through the core (the same queue, batches and prefix cache as generations), and
its vector comes back as floats or as base64 of little-endian float32 (what the `openai` SDK asks
for by default). An engine that generates answers 400 naming `model`, and says how to start one.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvharbor.common.logs import request_context
from kvharbor.common.openai_api import APIError, EmbeddingRequest, request_id
from kvharbor.common.tracing import extract
from kvharbor.engine.core_io import EngineRequest
from kvharbor.engine.pooling import finish_vector
from kvharbor.engine.sampling_params import SamplingParams


def encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


class EmbeddingRoutes:
    """`routes` is the server's _Routes (engine/serve/api_server.py): its parsing, queue and core."""

    def __init__(self, routes: Any, run_cls: Any) -> None:
        self.routes, self.run_cls = routes, run_cls

    async def embeddings(self, request: Request) -> Response:
        routes = self.routes
        parsed = await routes._parse(request, EmbeddingRequest)
        body: EmbeddingRequest = parsed.body
        if routes._check_model(body.model) is not None:
            raise APIError(400, "embeddings run on the base model, not a LoRA adapter", param="model")
        info = routes.engine
        if info.pooling is None:
            raise APIError(400, f"this engine generates with {routes.state.model!r} and serves no embeddings: start "
                           "one with `kvharbor serve --task embed` (or an embedding model), or send chat and "
                           "completions here", param="model", code="model_not_embedding")  # fmt: skip
        if body.dimensions is not None and body.dimensions > info.hidden_size:
            raise APIError(400, f"dimensions {body.dimensions} is more than this model's {info.hidden_size}",
                           param="dimensions")  # fmt: skip
        batch = self._tokens(body)
        routes._check_queue(batch)
        rid = request_id(body.request_id, request.headers.get("x-request-id"), "embd")
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=info.pooling.mode, speculative=False)
        span = routes.state.tracer.start_span(f"engine {request.url.path}", context=extract(request.headers))
        span.set_attribute("kvharbor.request_id", rid)
        with request_context(rid):
            requests = [EngineRequest(rid if len(batch) == 1 else f"{rid}-{k}", ids, params, priority=body.priority,
                                      tenant=body.user, cache_salt=body.cache_salt) for k, ids in enumerate(batch)]
            try:
                streams = await routes._submit(requests, body)
            except BaseException:
                span.end()
                raise
            run = self.run_cls(routes.state, streams, time.monotonic(), request.url.path, rid, span)
            outputs = await run.collect(request)
        data = [{"object": "embedding", "index": k, "embedding": encoded(
            finish_vector(out.embedding, info.pooling.normalize, body.dimensions), body.encoding_format)}
            for k, out in enumerate(outputs)]  # fmt: skip
        tokens = sum(map(len, batch))
        answer = {"object": "list", "data": data, "model": body.model,
                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
        return JSONResponse(answer, headers={"X-Request-Id": rid, **parsed.headers()})

    def _tokens(self, body: EmbeddingRequest) -> list[list[int]]:
        batch = []
        for item in body.inputs():
            if isinstance(item, str):
                self.routes._need_tokenizer()
                batch.append(self.routes.tokenizer.encode(item))
            else:
                batch.append(list(item))
        return batch
