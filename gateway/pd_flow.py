"""A call's P/D step: decide, and when a prefill engine is worth it, run the prefill
there and hand its KV to the decode engine.

A prefill that fails leaves the request colocated, counted as prefill_failed (or prefill_timeout,
past its deadline). A short output may instead be served whole by the prefill engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import replace
from typing import Protocol
from urllib.parse import urlsplit

from opentelemetry import trace

from kvharbor.common.openai_api import APIError
from kvharbor.common.tracing import inject
from kvharbor.gateway.call import Call
from kvharbor.gateway.catalog import handoff_peers
from kvharbor.gateway.disagg import Decision, decide, prefill_pool
from kvharbor.gateway.disagg import Request as PDRequest
from kvharbor.gateway.engine_body import engine_body, prefill_body
from kvharbor.gateway.engines import Engine, Sent
from kvharbor.gateway.predict import uncached_tokens
from kvharbor.gateway.proxy import EngineFailed, EngineRefused
from kvharbor.gateway.router import Route
from kvharbor.gateway.state import GatewayState


class CallPath(Protocol):
    """What the P/D step reads of a call's path (gateway/flow.py's RequestFlow, which calls it):
    the gateway's state, the call, its headers, whether its stream may migrate, and how in-flight
    work goes on an engine."""

    state: GatewayState
    call: Call
    headers: dict[str, str]
    migratable: bool

    def send(self, engine: Engine, uncached: int | None = None) -> Sent: ...

log = logging.getLogger("kvharbor.gateway.api")

# A P/D prefill's deadline, in predicted TTFTs (at least --pd-prefill-deadline-s): past it the
# prefill engine counts as stalled. Predictions from EWMAs of a busy engine can be off by 2x.
PREFILL_DEADLINE_X_TTFT = 4.0
# With no measured prefill rate (a fresh or restarted engine predicts a TTFT of 0), the deadline
# allows the prompt at this many tokens a second: a slow CPU engine, so that a long first prompt is
# not taken for a stall.
UNMEASURED_PREFILL_TOKENS_PER_S = 100.0
# Decisions that had no choice to make: not logged per request.
_UNREMARKABLE = ("off", "no_prefill_engine", "unsupported")


def prefill_deadline(floor_s: float, predicted_ttft_s: float, prompt_tokens: int) -> float:
    """Seconds a P/D prefill engine gets before it counts as stalled."""
    if predicted_ttft_s > 0:
        return max(floor_s, PREFILL_DEADLINE_X_TTFT * predicted_ttft_s)
    return max(floor_s, prompt_tokens / UNMEASURED_PREFILL_TOKENS_PER_S)


class PrefillStalled(Exception):
    """A P/D prefill engine did not answer within its deadline."""


async def disaggregate(flow: CallPath, route: Route) -> Route:
    """Runs the call's P/D step, leaving a hand-off on `flow.call.transfer` when a prefill ran
    elsewhere. Returns the route the request takes: the routed one, or one to the prefill engine
    that serves a short output whole (with what that engine holds of the prompt, and its KV format)."""
    state, call = flow.state, flow.call
    decision, held = await _decision(flow, route)
    tried = decision.prefill
    if decision.disaggregated:
        deadline = prefill_deadline(state.router.config.pd_prefill_deadline_s, decision.ttft_s, call.prompt_tokens)
        failure = "prefill_failed"
        try:
            call.transfer = await _prefill(flow, route, decision.prefill, deadline)
        except PrefillStalled:
            call.transfer, failure = None, "prefill_timeout"
        except asyncio.CancelledError:  # decided, then cancelled (the flow counts its route too)
            state.metrics.pd_decisions.labels(call.model.name, decision.reason).inc()
            raise
        if call.transfer is None:
            decision = Decision(None, failure)
    state.metrics.pd_decisions.labels(call.model.name, decision.reason).inc()
    if decision.reason not in _UNREMARKABLE:  # why its prefill ran where it did, where there was a choice
        log.info("P/D decision", extra={
            "reason": decision.reason, "prompt_tokens": call.prompt_tokens, "decode": route.engine.url,
            "prefill": (decision.whole or tried or route.engine).url,
            "gain_ms": _ms(decision.gain_s), "ttft_ms": _ms(decision.ttft_s),
            "transfer_ms": _ms(decision.transfer_s)})  # fmt: skip
    if call.span is not None:
        call.span.set_attribute("kvharbor.pd", decision.reason)
    if decision.whole is None:
        return route
    formats = {**route.kv_formats, decision.whole.url: decision.whole.load.kv_format}
    return replace(route, held=held, kv_formats=formats).to(decision.whole, "short_output")


async def _decision(flow: CallPath, route: Route) -> tuple[Decision, dict[str, int]]:
    """The decision, and the blocks of the prompt each engine holds (the prefill pool's too)."""
    state, call = flow.state, flow.call
    config = state.router.config
    if config.disaggregation == "off":
        return Decision(None, "off"), route.held
    if not route.engine.kind.takes_handoffs:  # a vLLM engine reads kv_transfer_params otherwise
        return Decision(None, "unsupported"), route.held
    everyone = handoff_peers(state.pool.all(call.model.name), route.engine, call.adapter)
    pool = prefill_pool([e for e in everyone if e.routable])
    held = dict(route.held)
    if pool and call.pd_supported:  # what the prefill engines hold: their misses cost there
        found = await state.router.matches(call.model.name, call.hashes, pool) or {}
        held.update({e.url: found.get(e.instance_id or "", 0) for e in pool})
    request = PDRequest(call.prompt_tokens, held, call.block_size, call.model.slo_ttft_s, call.pd_supported,
                        call.body.max_new_tokens())  # fmt: skip
    configured = any(e.role == "prefill" for e in everyone)
    decision = decide(route.engine, pool, request, config.pd_min_gain_ms / 1000, configured, config.pd_transfer_trust_s)
    return decision, held


async def _prefill(flow: CallPath, route: Route, engine: Engine, deadline: float) -> dict | None:
    """The prompt's prefill on `engine`, kept there for the decode engine: its hand-off, or None
    when the engine fails it. Raises PrefillStalled, counting a failure against the engine (as
    a stream that never starts does; enough of them, or failed /load polls, eject it), when it
    has not answered within `deadline` seconds: a stopped or wedged process accepts the
    connection and never answers, and the request waited for the whole request timeout."""
    state, call = flow.state, flow.call
    body = prefill_body(engine_body(call, route, engine, flow.migratable))
    sent = flow.send(engine, uncached_tokens(call.prompt_tokens, 0, call.block_size))
    stalled = False
    with state.tracer.start_as_current_span("gateway prefill") as span:
        span.set_attribute("kvharbor.engine", engine.url)
        try:
            headers = inject(dict(flow.headers))  # under this span
            content, _ = await asyncio.wait_for(state.caller.call(engine, call.path, body, headers), deadline)
            transfer = json.loads(content)["kv_transfer_params"]
        except TimeoutError:
            state.pool.failed(engine, "prefill deadline")
            log.warning("prefill engine stalled past its deadline; prefilling on the decode engine", extra={
                "engine": engine.url, "deadline_s": round(deadline, 3)})  # fmt: skip
            span.set_status(trace.StatusCode.ERROR, "prefill deadline")
            stalled = True
        except EngineRefused:
            raise  # the request's own fault: the decode engine would refuse it too
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


def _ms(seconds: float) -> float | None:
    """Milliseconds for a log field; None for an unknown (infinite) time, which JSON cannot hold."""
    return round(seconds * 1000, 1) if math.isfinite(seconds) else None
