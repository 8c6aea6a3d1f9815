"""The engine server: OpenAI's API over one engine core process (engine/serve/core_client.py), plus
/health, /ready, /load and /metrics.

Every error leaves as OpenAI's error JSON. Bodies over `max_body_bytes` get 413; while draining,
new work gets 503 with Retry-After. A client that goes away mid-request has its request aborted,
and its KV blocks are back in the pool before the next engine step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvharbor.common.admin_listener import PROBES, ListenerSplit
from kvharbor.common.http_errors import BodyGuardMiddleware, install_error_handlers, send_error
from kvharbor.common.logs import request_context
from kvharbor.common.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    error_body,
    message_dicts,
    request_id,
)
from kvharbor.common.request_body import Parsed, document_bodies, read_body
from kvharbor.common.request_limits import RequestLimits
from kvharbor.common.tool_calls import ToolUse
from kvharbor.common.tracing import extract, setup_tracing
from kvharbor.engine.config import ServerConfig
from kvharbor.engine.core_io import (
    AdapterInUse,
    EngineDead,
    EngineError,
    EngineRequest,
    Failure,
    HandoffFailed,
    KVTransfer,
    StructuredOutputError,
    UnknownModel,
)
from kvharbor.engine.kv.handoff_handles import new_lease_key, sign_handle
from kvharbor.engine.outputs import RequestOutput
from kvharbor.engine.sampling_params import SamplingParams
from kvharbor.engine.serve.core_client import CoreClient, CoreStalled, RequestStream
from kvharbor.engine.serve.embeddings_api import EmbeddingRoutes
from kvharbor.engine.serve.metrics import ServerMetrics
from kvharbor.engine.serve.openai_responses import SSE_DONE, ResponseBuilder, sse
from kvharbor.engine.serve.slo_window import SLOWindow

log = logging.getLogger("kvharbor.engine.server")
RETRY_AFTER_S = "5"
_GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class ServerState:
    loop: CoreClient
    metrics: ServerMetrics
    instance_id: str
    max_body_bytes: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    # requests and prompt tokens that may wait for a first token (ServerConfig's names)
    max_waiting: tuple[int, int] = (ServerConfig.max_waiting_requests, ServerConfig.max_waiting_tokens)
    draining: bool = False
    ready: bool = True
    shared_store: bool = False  # the core has a shared block store (--redis-url)
    allow_runtime_lora: bool = False  # serve /v1/load_lora_adapter and /v1/unload_lora_adapter
    slo: SLOWindow = field(default_factory=lambda: SLOWindow(2.0, 0.2))
    tracer: Any = field(default_factory=lambda: setup_tracing("engine"))

    @property
    def model(self) -> str:
        return self.loop.model_name


# -- middleware: body limit and drain gate --------------------------------------------------------


class GateMiddleware:
    """Pure ASGI: refuse new work while draining (503 + Retry-After)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        guarded = scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith(_GUARDED_PREFIXES)
        if guarded and self.state.draining:
            err = APIError(
                503,
                "this engine is draining; retry on another instance",
                type="service_unavailable",
                code="draining",
                headers={"Retry-After": RETRY_AFTER_S},
            )
            await send_error(send, err)
            return
        await self.app(scope, receive, send)


# -- the app --------------------------------------------------------------------------------------


# On the admin listener when there is one (common/admin_listener.py); /load stays on both: the
# gateway, a kvharbor part, polls it on the port it routes to.
ADMIN_PATHS = ("/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def build_app(state: ServerState, lifespan: Any = None, admin_port: int | None = None) -> FastAPI:
    app = FastAPI(title="kvharbor engine", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.kvharbor = state
    install_error_handlers(app, log, lambda path, status: state.metrics.requests.labels(path, str(status)).inc())
    routes = _Routes(state)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/embeddings")(EmbeddingRoutes(routes, _Run).embeddings)
    app.get("/v1/models")(routes.models)
    if state.allow_runtime_lora:
        app.post("/v1/load_lora_adapter")(routes.load_lora)
        app.post("/v1/unload_lora_adapter")(routes.unload_lora)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.get("/health")(routes.health)
    app.get("/ready")(routes.ready)
    app.get("/load")(routes.load)
    app.get("/metrics")(routes.metrics)
    app.add_middleware(BodyGuardMiddleware, limit=state.max_body_bytes, prefixes=_GUARDED_PREFIXES)
    app.add_middleware(GateMiddleware, state=state)  # a draining engine reads no bodies
    app.add_middleware(ListenerSplit, admin_port=admin_port, admin_paths=ADMIN_PATHS, both=(*PROBES, "/load"))
    document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/embeddings": EmbeddingRequest})  # fmt: skip
    return app


class _Routes:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.loop = state.loop
        self.engine = state.loop.info  # the core's model name, context, vocabulary, block size
        self.tokenizer = state.loop.tokenizer

    # -- helpers ----------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for what is not served here."""
        if model is None or model == self.state.model:
            return None
        adapters = self.loop.load.lora_adapters
        if model in adapters:
            return model
        served = ", ".join([repr(self.state.model), *map(repr, sorted(adapters))])
        message = f"model {model!r} is not served here; this engine serves {served}"
        raise APIError(404, message, param="model", code="model_not_found")

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompt_token_ids", param="prompt")

    def _params(self, body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        if body.kv_prefix_source == "shared" and not self.state.shared_store:
            raise APIError(
                400,
                "kv_prefix_source=shared needs a shared block store: start the engine with --redis-url",
                param="kv_prefix_source",
            )
        kwargs = body.sampling_kwargs()
        if body.kv_transfer_params is not None and body.kv_transfer_params.do_remote_decode:
            kwargs["max_tokens"] = 1  # a hand-off prefill samples the first token; the decode engine the rest
        try:
            params = SamplingParams(**kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param=getattr(exc, "field", None)) from None
        return params

    def _check_transfer(self, body: Any, prompts: int) -> None:
        """P/D requests (engine/kv/kv_handoff.py) only where this engine's role takes them."""
        transfer = body.kv_transfer_params
        if transfer is None:
            return
        role, port = self.engine.role, self.engine.kv_transfer_port
        if prompts != 1:
            raise APIError(400, "kv_transfer_params takes exactly one prompt", param="kv_transfer_params")
        if transfer.do_remote_decode and (role == "decode" or not port):
            raise APIError(
                400,
                f"this engine (role {role}) hands off no KV: start it with --role prefill, or --kv-transfer-port",
                param="kv_transfer_params",
            )
        if transfer.do_remote_decode and body.stream:
            raise APIError(400, "a hand-off prefill is not streamed: send stream=false", param="stream")
        if not transfer.do_remote_decode and role == "prefill":
            raise APIError(
                400, "this engine has role prefill: send continuations to a decode engine", param="kv_transfer_params"
            )

    def _check_queue(self, batch: list[list[int]]) -> None:
        """429 when the request would take this engine's queue (requests with no first token
        yet) past max_waiting_requests or max_waiting_tokens; an empty queue takes anything."""
        waiting, tokens = self.loop.queued
        if not waiting:
            return
        most_requests, most_tokens = self.state.max_waiting
        over = None
        if waiting + len(batch) > most_requests:
            over = f"{waiting} requests wait here for their first token, and its limit is {most_requests} " \
                   "(max_waiting_requests)"  # fmt: skip
        elif tokens + sum(map(len, batch)) > most_tokens:
            over = f"{tokens} prompt tokens wait here, and its limit is {most_tokens} (max_waiting_tokens)"
        if over is not None:
            raise APIError(429, f"this engine's queue is full: {over}; retry shortly or on another engine",
                           type="rate_limit_error", code="engine_queue_full",
                           headers={"Retry-After": "1"})  # fmt: skip

    async def _submit(self, requests: list[EngineRequest], body: Any) -> list[tuple[str, RequestStream]]:
        """Send every prompt of one API request to the core at once, in the queue place
        `_check_queue` found, and wait until the core took them all; on any failure none stays."""
        sent: list[str] = []
        refused: BaseException | None = None
        try:
            for request in requests:  # no await in between: the queue's places are taken as checked
                sent.append(self.loop.submit(request))
        except (ValueError, EngineDead) as exc:
            refused = exc
        try:  # the ones sent are waited on even so: each answer settles its bookkeeping
            taken = await asyncio.gather(*(self.loop.taken(rid) for rid in sent), return_exceptions=True)
        except BaseException:  # cancelled: the client went away
            for rid in sent:
                self.loop.abort(rid)
            raise
        failed = refused or next((t for t in taken if isinstance(t, BaseException)), None)
        if failed is not None:
            for rid in sent:  # nobody will read the others
                self.loop.abort(rid)
            raise _refusal(failed, body) from None
        return list(zip(sent, taken, strict=True))

    # -- OpenAI endpoints -------------------------------------------------------------------------

    async def _parse(self, request: Request, model_cls: type) -> Parsed:
        """The body, read once at this edge (common/request_body.py): 400 naming the field."""
        return await read_body(request, model_cls, self.state.limits, self.state.metrics.ignored_fields)

    async def chat(self, request: Request) -> Response:
        parsed = await self._parse(request, ChatCompletionRequest)
        body = parsed.body
        lora = self._check_model(body.model)
        if body.prompt_token_ids is not None:
            ids = list(body.prompt_token_ids)
        else:
            self._need_tokenizer()
            try:
                ids = self.tokenizer.encode_chat(message_dicts(body.messages), tools=body.prompt_tools())
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        rid = request_id(body.request_id, request.headers.get("x-request-id"), "chatcmpl")
        return await self._generate("chat", rid, [ids], [""], parsed, request, lora)

    async def completions(self, request: Request) -> Response:
        parsed = await self._parse(request, CompletionRequest)
        body = parsed.body
        lora = self._check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        batch, echo = [], []
        for p in prompts:
            if isinstance(p, str):
                self._need_tokenizer()
                batch.append(self.tokenizer.encode(p))
                echo.append(p if body.echo else "")
            else:
                batch.append(list(p))
                echo.append(self.tokenizer.decode(p) if body.echo and self.tokenizer else "")
        rid = request_id(body.request_id, request.headers.get("x-request-id"), "cmpl")
        return await self._generate("completion", rid, batch, echo, parsed, request, lora)

    async def _generate(
        self,
        kind: str,
        rid: str,
        batch: list[list[int]],
        echo: list[str],
        parsed: Parsed,
        request: Request,
        lora: str | None = None,
    ) -> Response:
        body = parsed.body
        self._check_transfer(body, len(batch))
        self._check_queue(batch)
        hand_off = body.kv_transfer_params is not None and body.kv_transfer_params.do_remote_decode
        lease = new_lease_key(rid) if hand_off else None  # one prompt (_check_transfer): its id is rid
        params = self._params(body)
        arrival = time.monotonic()
        # Continues the caller's trace (the gateway's traceparent); ends when the request does.
        span = self.state.tracer.start_span(f"engine {request.url.path}", context=extract(request.headers))
        span.set_attribute("kvharbor.request_id", rid)
        span.set_attribute("kvharbor.instance_id", self.state.instance_id)
        if lora is not None:
            span.set_attribute("kvharbor.lora", lora)
            self.state.metrics.lora_requests.labels(lora).inc()
        with request_context(rid):
            transfer = None
            if body.kv_transfer_params is not None:  # `lease`: the hand-off's key, signed in the answer
                transfer = KVTransfer(**body.kv_transfer_params.wire(), lease=lease)
            requests = [
                EngineRequest(rid if len(batch) == 1 else f"{rid}-{k}", ids, params, priority=body.priority,
                              tenant=body.user, cache_salt=body.cache_salt, lora=lora,
                              kv_prefix_source=body.kv_prefix_source, transfer=transfer)
                for k, ids in enumerate(batch)
            ]  # fmt: skip
            try:
                streams = await self._submit(requests, body)
            except BaseException:
                span.end()
                raise
            log.info(
                "admitted",
                extra={
                    "kind": kind,
                    "prompts": len(batch),
                    "prompt_tokens": sum(map(len, batch)),
                    "n": params.n,
                    "max_tokens": params.max_tokens,
                    "stream": body.stream,
                    "lora": lora,
                },
            )
        builder = ResponseBuilder(
            kind, rid, lora or self.state.model, self.tokenizer, params.n, body.return_token_ids,
            getattr(body, "text_offset", 0),  # completions only: chat logprobs carry no offsets
            _tools(body, self.tokenizer), self.tokenizer.reasoning_parser if self.tokenizer else None,
        )  # fmt: skip
        run = _Run(self.state, streams, arrival, request.url.path, rid, span)
        if body.stream:
            return StreamingResponse(
                run.stream(builder, kind, body.num_logprobs() is not None, echo, body.include_usage),
                media_type="text/event-stream",
                headers={"X-Request-Id": rid, "Cache-Control": "no-cache", **parsed.headers()},
            )
        outputs = await run.collect(request)
        response = builder.response(outputs, body.num_logprobs() is not None, echo)
        if lease is not None:
            response["kv_transfer_params"] = self._handoff(request, lease, outputs[0])
        return JSONResponse(response, headers={"X-Request-Id": rid, **parsed.headers()})

    def _handoff(self, request: Request, lease: str, output: RequestOutput) -> dict:
        """What the decode engine needs to continue this prefill (the gateway may set the host)."""
        return {
            "remote_host": request.url.hostname or "127.0.0.1",
            "remote_port": self.engine.kv_transfer_port,
            "remote_handle": sign_handle(self.engine.kv_transfer_secret, lease),
            "first_token_id": output.outputs[0].token_ids[0],
        }

    async def models(self) -> dict:
        """The base model, and each LoRA adapter with the base as its parent (vLLM's shape)."""
        now, base = int(time.time()), self.state.model
        entry = {"object": "model", "created": now, "owned_by": "kvharbor", "max_model_len": self.engine.max_model_len}
        names = sorted(self.loop.load.lora_adapters)
        adapters = [{"id": name, **entry, "parent": base, "root": base} for name in names]
        return {"object": "list", "data": [{"id": base, **entry, "parent": None, "root": base}, *adapters]}

    async def load_lora(self, body: LoadLoRARequest) -> dict:
        """Serve another adapter (--allow-runtime-lora); 400 for a bad folder, nothing half-loaded."""
        await self._lora_op("load", body.lora_name, body.lora_path)
        return {"object": "lora_adapter", "id": body.lora_name, "parent": self.state.model, "status": "loaded"}

    async def unload_lora(self, body: UnloadLoRARequest) -> dict:
        await self._lora_op("unload", body.lora_name, None)
        return {"object": "lora_adapter", "id": body.lora_name, "parent": self.state.model, "status": "unloaded"}

    async def _lora_op(self, action: str, name: str, path: str | None) -> None:
        if name == self.state.model:
            raise APIError(400, f"{name!r} is the base model's name: give the adapter another", param="lora_name")
        try:
            await self.loop.lora(action, name, path)
        except EngineDead as exc:
            raise APIError(503, str(exc), type="service_unavailable", headers={"Retry-After": RETRY_AFTER_S}) from None
        except UnknownModel as exc:
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        except AdapterInUse as exc:
            raise APIError(409, str(exc), type="conflict", param="lora_name") from None
        except ValueError as exc:
            param = "lora_name" if "name" in str(exc) else "lora_path"
            raise APIError(400, str(exc), param=param) from None
        log.info(f"LoRA adapter {action}ed", extra={"adapter": name})

    async def tokenize(self, body: TokenizeRequest) -> dict:  # adapters share the base model's tokenizer
        self._check_model(body.model)
        self._need_tokenizer()
        if body.messages is not None:
            try:
                tokens = self.tokenizer.encode_chat(message_dicts(body.messages))
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        else:
            tokens = self.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": self.engine.max_model_len}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self._check_model(body.model)
        self._need_tokenizer()
        vocab = self.engine.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # -- operations -------------------------------------------------------------------------------

    async def health(self) -> Response:
        if not self.loop.alive:
            return JSONResponse({"status": "dead", "error": repr(self.loop.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready(self) -> Response:
        ok = self.state.ready and not self.state.draining and self.loop.alive
        body = {"ready": ok, "draining": self.state.draining, "model": self.state.model}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def load(self) -> dict:
        attainment, counted = self.state.slo.attainment()
        return self.loop.load.with_server(
            instance_id=self.state.instance_id,
            draining=self.state.draining,
            in_flight=self.loop.num_in_flight,
            core_silent_s=round(time.monotonic() - self.loop.heard_at, 2),
            slo_requests=counted,
            slo_attainment=attainment,
        ).to_json()

    async def metrics(self) -> Response:
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4")


def _refusal(exc: BaseException, body: Any) -> BaseException:
    """The API's answer to a request the core did not take (`exc` as the core raised it)."""
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), type="service_unavailable", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, CoreStalled):
        return APIError(504, str(exc), type="timeout_error", code="core_add_timeout")
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="internal_error")
    if isinstance(exc, HandoffFailed):
        return APIError(502, str(exc), type="kv_transfer_failed", param="kv_transfer_params")
    if isinstance(exc, UnknownModel):  # unloaded after _check_model looked
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, StructuredOutputError):
        return APIError(400, str(exc), param=body.constraint_field() or "tools")
    if isinstance(exc, ValueError):  # the core names the field (FieldError), "prompt" for a chat's messages
        param = getattr(exc, "field", None)
        chat = isinstance(body, ChatCompletionRequest)
        return APIError(400, str(exc), param="messages" if chat and param == "prompt" else param)
    return exc  # cancelled, or a bug: as it is


def step_error(failure: Failure) -> APIError:
    """The API's answer to a request the core ended with an error: 400 where the request's own
    options failed it (the rest of its step went on; another engine would fail it too), 500
    where the engine's step failed (another engine may serve it)."""
    if failure.requests_fault:
        return APIError(
            400,
            f"this request failed in the engine on its own ({failure.message}); the requests beside it were "
            "unaffected: check its parameters, or report it with its x-request-id",
            code="request_failed",
        )
    return APIError(500, f"the engine failed on this request: {failure.message}", type="internal_error")


def _tools(body: Any, tokenizer: Any) -> ToolUse:
    """A chat request's tools (common/tool_calls.py), read in the model family's format; completions: none."""
    if not isinstance(body, ChatCompletionRequest):
        return ToolUse()
    return body.tool_use(tokenizer.tool_parser) if tokenizer is not None else body.tool_use()


class _Run:
    """One API request in flight: its engine streams, their timing, and their cancellation."""

    def __init__(
        self,
        state: ServerState,
        streams: list[tuple[str, RequestStream]],
        arrival: float,
        endpoint: str,
        rid: str,
        span: Any = None,
    ) -> None:
        self.span = span
        self.state = state
        self.streams = streams
        self.arrival = arrival
        self.endpoint = endpoint
        self.rid = rid
        self.finals: dict[str, RequestOutput] = {}
        self.token_times: dict[str, list[float]] = {engine_id: [] for engine_id, _ in streams}

    def abort(self) -> None:
        for engine_id, _ in self.streams:
            if engine_id not in self.finals:
                self.state.loop.abort(engine_id)

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, engine_id: str, stream: RequestStream) -> None:
            try:
                async for out, when in stream:
                    self.token_times[engine_id] += [when] * sum(len(c.delta_token_ids) for c in out.outputs)
                    await queue.put((k, out))
            except Exception as exc:
                await queue.put((k, exc))

        tasks = [asyncio.create_task(pump(k, eid, s)) for k, (eid, s) in enumerate(self.streams)]
        try:
            pending = len(tasks)
            while pending:
                k, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    self.finals[item.request_id] = item
                    pending -= 1
                yield k, item
        finally:
            for task in tasks:
                task.cancel()

    def _finish(self, status: int) -> None:
        self.state.metrics.requests.labels(self.endpoint, str(status)).inc()
        if self.span is not None:
            self.span.set_attribute("http.status_code", status)
            self.span.end()
        pulled = {engine_id: stream.imported_blocks for engine_id, stream in self.streams}
        for engine_id, final in self.finals.items():
            self.state.metrics.observe_request(self.arrival, self.token_times[engine_id], len(final.prompt_token_ids))
            self.state.slo.record(self.arrival, self.token_times[engine_id])
            if self.state.shared_store and not final.error:
                self.state.loop.record_reuse(len(final.prompt_token_ids), final.num_cached_tokens, pulled[engine_id])
        times = [t for ts in self.token_times.values() for t in ts]
        log.info(
            "finished",
            extra={
                "request_id": self.rid,
                "status": status,
                "finish_reasons": sorted({c.finish_reason or "none" for o in self.finals.values() for c in o.outputs}),
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in self.finals.values()),
                "cached_tokens": sum(o.num_cached_tokens for o in self.finals.values()),
                "pulled_blocks": sum(pulled.values()),
                "output_tokens": len(times),
                "ttft_ms": round((min(times) - self.arrival) * 1000, 1) if times else None,
                "e2e_ms": round((time.monotonic() - self.arrival) * 1000, 1),
            },
        )

    async def collect(self, request: Request) -> list[RequestOutput]:
        """Wait for every prompt to finish; abort if the client disconnects meanwhile."""
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            async for _k, _out in self._merged():
                pass
        except EngineDead as exc:
            self._finish(503)
            raise APIError(503, str(exc), type="service_unavailable", headers={"Retry-After": RETRY_AFTER_S}) from None
        finally:
            watcher.cancel()
            self.abort()
        outputs = [self.finals[engine_id] for engine_id, _ in self.streams]
        failed = next((o for o in outputs if o.error), None)
        if failed is not None:
            error = step_error(failed.error)
            self._finish(error.status)
            raise error
        self._finish(200)
        return outputs

    async def _watch_disconnect(self, request: Request) -> None:
        while True:
            await asyncio.sleep(0.25)
            if await request.is_disconnected():
                log.info("client disconnected; aborting", extra={"request_id": self.rid})
                self.abort()
                return

    async def stream(
        self, builder: ResponseBuilder, kind: str, want_logprobs: bool, echo: list[str], include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE chunks; a client that goes away cancels this generator, which aborts the request."""
        status = 200
        offsets: dict[int, int] = {}
        try:
            if kind == "chat":
                for k in range(len(self.streams)):
                    for i in range(builder.n):
                        yield sse(builder.role_chunk(k * builder.n + i))
            async for k, out in self._merged():
                for sample in out.outputs:
                    if not (sample.delta_text or sample.delta_token_ids or sample.finish_reason):
                        continue
                    index = k * builder.n + sample.index
                    if index not in offsets:
                        offsets[index] = builder.text_offset
                        if echo[k]:
                            yield sse(builder.text_chunk(index, echo[k]))
                            offsets[index] += len(echo[k])
                    chunk = builder.delta_chunk(index, sample, want_logprobs, offsets[index])
                    offsets[index] += len(sample.delta_text)
                    if chunk is not None:
                        yield sse(chunk)
                if out.finished and out.error:
                    error = step_error(out.error)
                    status = error.status
                    yield sse(error.body())
            if include_usage:
                yield sse(builder.usage_chunk([self.finals[eid] for eid, _ in self.streams]))
            yield SSE_DONE
        except EngineDead as exc:
            status = 503
            yield sse(error_body(str(exc), "service_unavailable"))
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = 499  # the client closed the connection
            log.info("client disconnected mid-stream; aborting", extra={"request_id": self.rid})
            raise
        finally:
            self.abort()
            self._finish(status)
