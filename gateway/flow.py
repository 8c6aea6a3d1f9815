"""A call's path to an engine and back: admission, route, P/D, send with retries, relay, migrate.

gateway/app.py does the front matter (authenticate, parse, limits) and hands each call to a
`RequestFlow`. The flow is the one place that asks the router (`choose`, with the engines already
tried left out), the one place that puts in-flight work on an engine (`send`), and builds each
engine body through gateway/engine_body.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvharbor.common.block_hash import block_hashes
from kvharbor.common.openai_api import APIError
from kvharbor.common.tracing import inject
from kvharbor.gateway.admission import QueueTimeout, Shed, fit_route
from kvharbor.gateway.call import Call, ModelEntry, count_finished, count_rejected, count_route
from kvharbor.gateway.catalog import adapter_engines
from kvharbor.gateway.disagg import decode_candidates
from kvharbor.gateway.engine_body import continued_payload, engine_body
from kvharbor.gateway.engines import Engine, Sent
from kvharbor.gateway.pd_flow import disaggregate
from kvharbor.gateway.predict import uncached_tokens
from kvharbor.gateway.proxy import EngineFailed, with_retries
from kvharbor.gateway.relay import Continuation, EngineStream, StreamRelay, StreamStats
from kvharbor.gateway.router import Route, block_size_for
from kvharbor.gateway.state import GatewayState

log = logging.getLogger("kvharbor.gateway.api")


@dataclass
class _OnEngine:
    """The engine a stream is on now, and its in-flight accounting (a migration moves both)."""

    engine: Engine | None = None
    sent: Sent | None = None


class RequestFlow:
    """One call from admission to its answer."""

    def __init__(self, state: GatewayState, call: Call) -> None:
        self.state, self.call = state, call
        self.headers = inject({"x-request-id": call.rid})  # under the call's span
        # A stream of one sequence can move to another engine when its engine fails mid-way; not
        # a tool call's: a second engine would open the call again (its id and name) mid-stream;
        # nor a reasoning model's: the second would not know it was inside the reasoning.
        tokenizer = call.model.tokenizer
        reasons = bool(tokenizer and tokenizer.reasoning_parser)
        self.migratable = bool(state.max_migrations) and call.one_sequence and not call.calls_tools and not reasons
        self.route: Route | None = None
        self.on = _OnEngine()
        self._moves = 0

    # -- routing and in-flight accounting -------------------------------------------------------

    def candidates(self, exclude: Collection[str] = ()) -> list[Engine]:
        """The routable engines that may take the whole request: of its base model, serving its
        adapter, not prefill-only (unless nothing else runs), not in `exclude` (urls)."""
        call = self.call
        engines = adapter_engines(self.state.pool.routable(call.model.name), call.adapter)
        return [e for e in decode_candidates(engines) if e.url not in exclude]

    async def choose(self, engines: list[Engine]) -> Route | None:
        """The router's route among `engines`, or None when there is none (no engine, or the
        router declines)."""
        if not engines:
            return None
        call, model = self.call, self.call.model
        return await self.state.router.choose(
            model.name, engines, call.hashes, call.prompt_tokens, call.block_size, model.slo_itl_s, call.adapter,
            call.known_held(),
        )

    def send(self, engine: Engine, uncached: int | None = None) -> Sent:
        """Puts the call's work on `engine`'s in-flight count (done() takes it off). `uncached`:
        the prompt tokens it must compute; by default what the route says it lacks."""
        call = self.call
        if uncached is None:
            uncached = self._uncached(engine)
        return engine.send(uncached, call.adapter, call.prompt_tokens)

    def _uncached(self, engine: Engine) -> int:
        call = self.call
        if call.transfer is not None:
            return call.prompt_tokens % call.block_size  # the hand-off brings every full block
        return uncached_tokens(call.prompt_tokens, self.route.held.get(engine.url, 0), call.block_size)

    def _body(self, engine: Engine) -> dict:
        return engine_body(self.call, self.route, engine, self.migratable and engine.kind.continues_streams)

    async def _pick_next(self, tried: set[str]) -> Engine | None:
        self.state.metrics.retries.labels(self.call.model.name).inc()
        route = await self.choose(self.candidates(exclude=tried))
        return route.engine if route else None

    # -- the path --------------------------------------------------------------------------------

    async def respond(self, request: Request, limit_headers: dict[str, str]) -> Response:
        """Admits, routes and sends the call; its answer (a stream settles itself when it ends)."""
        route = await self._admit()
        try:
            route = await disaggregate(self, route)
        except asyncio.CancelledError:  # cancelled while a prefill engine ran its prefill: it was routed
            count_route(self.state.metrics, self.call, route)
            raise
        count_route(self.state.metrics, self.call, route)
        self.route = route
        if self.call.body.stream:
            return await self._stream(limit_headers)
        return await self._unary(request, limit_headers)

    async def _admit(self) -> Route:
        state, call = self.state, self.call
        call.block_size = self._block_size(call.model)
        # Under the base model, the tenant's salt and the adapter's identity (not its name): what
        # the engines publish, so KV index lookups match. Once: retries and P/D reuse them.
        call.hashes = block_hashes(
            call.prompts[0], call.block_size, call.model.name, call.tenant.cache_salt, call.resolved.identity
        )
        try:
            route, queued = await state.admission.admit(
                call.tenant.name, call.tenant.priority, call.tenant.sheddable, self._try_now
            )
        except Shed as exc:
            count_rejected(state.metrics, call, "shed_" + exc.reason)
            message = ("the service is over its latency target and sheds low-priority requests; retry later"
                       if exc.reason == "slo" else "the admission queue is full; retry later")  # fmt: skip
            raise APIError(503, message, type="service_unavailable", code=f"shed_{exc.reason}",
                           headers={"Retry-After": "2"}) from None  # fmt: skip
        except QueueTimeout:
            count_rejected(state.metrics, call, "queue_timeout")
            raise APIError(
                503, f"no engine could take the request within {state.admission.timeout:.0f}s; retry later",
                type="service_unavailable", code="queue_timeout", headers={"Retry-After": "5"},
            ) from None  # fmt: skip
        state.metrics.queue_seconds.labels(call.tenant.name).observe(queued)
        return route

    async def _try_now(self) -> Route | None:
        """A route that fits the call's SLOs now, or None (admission waits and asks again)."""
        call, model = self.call, self.call.model
        engines = self.candidates()
        route = await self.choose(engines)
        if route is None:
            return None
        return fit_route(route, engines, call.prompt_tokens, call.block_size, model.slo_ttft_s, call.adapter,
                         slo_itl_s=model.slo_itl_s)  # fmt: skip

    def _block_size(self, model: ModelEntry) -> int:
        """The engines' block size (a mismatch is logged when it starts, and counted per request)."""
        state = self.state
        size, mismatch = block_size_for(model.block_size, state.pool.all(model.name))
        if mismatch:
            state.metrics.block_size_mismatches.labels(model.name).inc()
            if mismatch != model.mismatch:
                log.error("KV block size mismatch: prefix lookups on the other size miss", extra={
                    "model": model.name, "problem": mismatch})  # fmt: skip
        model.mismatch = mismatch
        return size

    async def _unary(self, request: Request, limit_headers: dict[str, str]) -> Response:
        state, call = self.state, self.call

        async def run(engine: Engine) -> tuple[bytes, dict]:
            sent = self.send(engine)
            try:
                answer = await state.caller.call(engine, call.path, self._body(engine), self.headers)
                call.served_by = engine.instance_id
                return answer
            finally:
                sent.done()

        work = with_retries(state.max_attempts, self.route.engine, self._pick_next, run)
        content, usage = await _unless_disconnected(request, work)
        count_finished(state.metrics, call, usage, None)
        # The engine's bytes as they came: parsing and re-encoding would only add latency.
        headers = {"x-request-id": call.rid, **limit_headers, **call.ignored}
        return Response(content, media_type="application/json", headers=headers)

    # -- streams ---------------------------------------------------------------------------------

    async def _open(self, engine: Engine, body: dict | None = None) -> EngineStream:
        """Opens the stream on `engine` (read up to its first token), moving the call's in-flight
        accounting there."""
        if body is None:
            body = self._body(engine)
        sent = self.send(engine)
        try:
            stream = await self.state.caller.open_stream(engine, self.call.path, body, self.headers)
        except BaseException:
            sent.done()
            raise
        sent.first_token()
        self.on.engine, self.on.sent = engine, sent
        self.call.served_by = engine.instance_id
        return stream

    async def _stream(self, limit_headers: dict[str, str]) -> Response:
        state, call = self.state, self.call
        stream = await with_retries(state.max_attempts, self.route.engine, self._pick_next, self._open)
        relay = StreamRelay(
            stream, call.rid, call.body.include_usage, self._debit, self._settle, deadline_s=state.stream_deadline,
            idle_s=state.stream_idle, renew=self._renew, renew_every_s=state.limiter.slot_ttl / 3,
            continuation=self._continuation(),
        )  # fmt: skip
        headers = {"x-request-id": call.rid, "Cache-Control": "no-cache", **limit_headers, **call.ignored}
        return GuardedStream(relay.lines(), relay.close, media_type="text/event-stream", headers=headers)

    async def _debit(self, tokens: int) -> None:
        await self.state.limiter.debit_tokens(self.call.tenant, tokens)

    async def _renew(self) -> None:
        await self.state.limiter.renew_slot(self.call.tenant, self.call.slot, self.call.weight)

    async def _settle(self, stats: StreamStats) -> None:
        """The stream is over: in-flight work, its slot, its metrics and its span end here."""
        state, call = self.state, self.call
        self.on.sent.done()
        if stats.timeout is not None:
            state.metrics.stream_timeouts.labels(call.model.name, stats.timeout).inc()
        if stats.migrations:
            state.metrics.stream_migrations.labels(call.model.name, "moved").inc(stats.migrations)
        if stats.migration_failed:
            state.metrics.stream_migrations.labels(call.model.name, "failed").inc()
        if stats.finished_here:
            state.metrics.stream_migrations.labels(call.model.name, "finished").inc()
        await state.limiter.release(call.tenant, call.slot, call.weight)
        count_finished(state.metrics, call, stats.usage, stats)
        if call.span is not None:
            call.span.end()

    def _continuation(self) -> Continuation | None:
        """How this stream goes on if its engine fails mid-way: one prompt, one sample (the prompt
        plus the tokens streamed so far is one sequence), and migrations allowed."""
        if not self.migratable or not self.route.engine.kind.continues_streams:
            return None  # migration continues a kvharbor engine's stream (its token ids, its grammar)
        call = self.call
        return Continuation(self._resume, self.state.max_migrations, call.max_tokens, call.prompt_tokens,
                            not call.body.return_token_ids)  # fmt: skip

    async def _resume(self, streamed: list[int], failure: str, delivered: str) -> EngineStream:
        """Continues the broken stream on another engine, from the tokens it streamed."""
        call = self.call
        self._moves += 1
        failed = self.on.engine
        self.on.sent.done()
        self.state.pool.failed(failed, f"failed mid-stream ({failure})", hard=failure == "hard")
        chosen = await self.choose(self.candidates(exclude={failed.url}))
        if chosen is None:
            raise EngineFailed("no other engine to continue the stream on")
        body = continued_payload(self._body(chosen.engine), call, streamed, call.max_tokens, self._moves, delivered)
        try:
            return await self._open(chosen.engine, body)
        except EngineFailed as exc:
            if exc.blame is not None:
                exc.blame()  # the stream ran elsewhere until now: this engine is at fault
            raise


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


class GuardedStream(StreamingResponse):
    """A StreamingResponse that settles its request even when the body never starts (a client
    gone before the first byte): Starlette would otherwise drop the generator unrun."""

    def __init__(self, content: AsyncIterator[str], settle: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._settle = settle

    def mapped(self, body: AsyncIterator[str]) -> GuardedStream:
        """This stream's settle and headers around another body made from its own (the Responses
        event stream of a chat stream): settled once, by the stream the client reads."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("content-length", "content-type")}
        return GuardedStream(body, self._settle, media_type=self.media_type, headers=headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._settle()
