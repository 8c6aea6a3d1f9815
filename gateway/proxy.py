"""Calling engines: retries before the first token, and OpenAI-shaped failures.

A call is retried on another engine when the engine cannot be reached, answers 5xx (draining
included), answers 404 `model_not_found` (it unloaded a LoRA adapter after its last /load said
it had it), or its stream sends an error or ends before the first token. An engine is blamed for
a 500 or an error event (other than `service_unavailable`) only once another engine has served the
same request: a request that fails that way on every engine tried is its own fault (the client
gets a 500), so one poison request sent a few times cannot eject the whole fleet. Once a token has reached
the client the request is bound to its engine (gateway/relay.py relays the rest: if that stream
breaks, the client gets an OpenAI error event and `data: [DONE]`, never a hang; every read has a
timeout).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import httpx

from kvharbor.common.openai_api import APIError
from kvharbor.gateway import sse
from kvharbor.gateway.engines import Engine, EnginePool
from kvharbor.gateway.relay import EngineStream

log = logging.getLogger("kvharbor.gateway.proxy")
T = TypeVar("T")


class EngineFailed(Exception):
    """This engine could not serve the request before its first token: try another. `blame`
    counts the failure against the engine, called by with_retries only once another engine
    serves the request; None when it was counted already (or is not the engine's: draining)."""

    def __init__(self, message: str, blame: Callable[[], None] | None = None, busy: bool = False) -> None:
        super().__init__(message)
        self.blame = blame
        self.busy = busy  # the engine's queue was full (its 429): another may have room; no one's fault


class EngineRefused(APIError):
    """An engine refused the request as the request's own fault (a 4xx, or an error event of type
    invalid_request_error before the first token): the client's answer as the engine gave it.
    Never retried on another engine (it would refuse it too), never counted against the engine;
    counted by `reason` (kvharbor_gateway_requests_refused_total)."""

    @property
    def reason(self) -> str:
        """The engine's error code, else the field it named (`invalid_<field>`): a metric label,
        so only short snake_case names pass."""
        code, field = self.code, str(self.param or "").split(".")[0]
        if isinstance(code, str) and _REASON.fullmatch(code):
            return code
        if _REASON.fullmatch(f"invalid_{field}"):
            return f"invalid_{field}"
        return "not_found" if self.status == 404 else "too_many_requests" if self.status == 429 else "invalid_request"


_REASON = re.compile(r"[a-z][a-z0-9_]{0,47}")


def _engine_error(resp_status: int, text: str) -> EngineRefused:
    try:
        return _refused(resp_status, json.loads(text)["error"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return EngineRefused(resp_status, text[:500] or f"engine answered {resp_status}")


def _refused(status: int, err: dict) -> EngineRefused:
    """An engine's OpenAI error object (from its body or an SSE error event) as the client's answer."""
    return EngineRefused(
        status,
        err.get("message", str(err)[:500]),
        type=err.get("type", "invalid_request_error"),
        param=err.get("param"),
        code=err.get("code"),
    )


def _lost_model(engine: Engine, error: APIError) -> Exception:
    """The error to raise for an engine's 4xx: EngineFailed (retry elsewhere) when the engine no
    longer serves the model it was routed for, which the gateway checked, or its queue is full
    (a 429: another engine may have room), so not the client's fault."""
    if error.status == 429:
        return EngineFailed(f"{engine.url}: {error.message}", busy=True)
    if error.status == 404 and error.code == "model_not_found":
        log.warning("engine no longer serves the model; trying another", extra={"engine": engine.url})
        return EngineFailed(f"{engine.url}: {error.message}")
    return error


class EngineCaller:
    def __init__(
        self,
        http: httpx.AsyncClient,
        pool: EnginePool,
        connect_timeout: float,
        first_token_timeout: float,
        request_timeout: float,
    ) -> None:
        self.http = http
        self.pool = pool
        # Streams must start within first_token_timeout; an unstreamed answer comes whole, so it
        # may take the whole request_timeout.
        self.timeout = httpx.Timeout(request_timeout, connect=connect_timeout, read=first_token_timeout)
        self.unstreamed_timeout = httpx.Timeout(request_timeout, connect=connect_timeout)

    async def call(self, engine: Engine, path: str, payload: dict, headers: dict[str, str]) -> tuple[bytes, dict]:
        """One unstreamed call: (the engine's JSON as sent, its usage). Raises EngineFailed (retry
        elsewhere: the engine is ejected meanwhile too) or APIError (the client's fault)."""
        return await _unless_lost(engine, self._call(engine, path, payload, headers))

    async def _call(self, engine: Engine, path: str, payload: dict, headers: dict[str, str]) -> tuple[bytes, dict]:
        try:
            resp = await self.http.post(
                engine.url + path, json=payload, headers=headers, timeout=self.unstreamed_timeout
            )
        except httpx.ConnectError as exc:
            self.pool.failed(engine, "connect", hard=True)
            raise EngineFailed(f"{engine.url}: {exc}") from exc
        except httpx.ReadTimeout:
            # The engine accepted the work and is still at it: running it again elsewhere would
            # only double the load. Not the engine's fault either.
            raise APIError(
                504,
                "the engine did not finish within the request timeout",
                type="timeout_error",
                code="request_timeout",
            ) from None
        except httpx.HTTPError as exc:
            self.pool.failed(engine, type(exc).__name__)
            raise EngineFailed(f"{engine.url}: {type(exc).__name__}") from exc
        if resp.status_code >= 500:
            blame = self._server_error(engine, resp.status_code)
            raise EngineFailed(f"{engine.url} answered {resp.status_code}", blame)
        if resp.status_code != 200:
            raise _lost_model(engine, _engine_error(resp.status_code, resp.text))
        self.pool.succeeded(engine)
        try:
            usage = resp.json().get("usage") or {}
        except (ValueError, AttributeError):
            usage = {}
        return resp.content, usage

    def _server_error(self, engine: Engine, status: int) -> Callable[[], None] | None:
        """Count a 5xx against the engine now, or (500: the engine's handler raised, maybe for this
        request alone) return the blame for with_retries to count if another engine serves it."""
        if status == 503:
            engine.draining = True  # until the next poll says otherwise
        elif status == 500:
            return lambda: self.pool.failed(engine, "HTTP 500")
        else:
            self.pool.failed(engine, f"HTTP {status}")
        return None

    async def open_stream(self, engine: Engine, path: str, payload: dict, headers: dict[str, str]) -> EngineStream:
        """Open a stream and read up to its first token. Raises EngineFailed (retry elsewhere: no
        answer, 5xx, an error event or the end before any token, or the engine ejected meanwhile)
        or APIError (the client's fault) before anything reaches the client."""
        return await _unless_lost(engine, self._open_stream(engine, path, payload, headers))

    async def _open_stream(self, engine: Engine, path: str, payload: dict, headers: dict[str, str]) -> EngineStream:
        request = self.http.build_request(
            "POST", engine.url + path, json=payload, headers=headers, timeout=self.timeout
        )
        try:
            resp = await self.http.send(request, stream=True)
        except httpx.ConnectError as exc:
            self.pool.failed(engine, "connect", hard=True)
            raise EngineFailed(f"{engine.url}: {exc}") from exc
        except httpx.HTTPError as exc:
            self.pool.failed(engine, type(exc).__name__)
            raise EngineFailed(f"{engine.url}: {type(exc).__name__}") from exc
        try:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                if resp.status_code >= 500:
                    blame = self._server_error(engine, resp.status_code)
                    raise EngineFailed(f"{engine.url} answered {resp.status_code}", blame)
                raise _lost_model(engine, _engine_error(resp.status_code, text))
            lines = resp.aiter_lines()
            head, first_token = await self._head(engine, lines)
        except httpx.HTTPError as exc:
            await resp.aclose()
            self.pool.failed(engine, type(exc).__name__)
            raise EngineFailed(f"{engine.url}: stream broke before the first token ({type(exc).__name__})") from exc
        except BaseException:
            await resp.aclose()
            raise
        self.pool.succeeded(engine)
        return EngineStream(resp, head, lines, first_token)

    async def _head(self, engine: Engine, lines: AsyncIterator[str]) -> tuple[list[sse.Event], float | None]:
        """The events up to the first token (or [DONE]), and when that token came."""
        head: list[sse.Event] = []
        async for line in lines:
            event = sse.parse(line)
            if event.kind == sse.ERROR and _error_type(event) == "invalid_request_error":
                raise _refused(400, event.chunk["error"])  # the request's own fault: no retry
            if event.kind == sse.ERROR:
                # The engine failed before any token reached the client: another may not.
                blame = functools.partial(self.pool.failed, engine, "error before the first token")
                if _error_type(event) == "service_unavailable":  # the engine says it is at fault
                    blame()
                    blame = None
                raise EngineFailed(f"{engine.url} failed before the first token: {event.error_message}", blame)
            head.append(event)
            if event.kind == sse.TOKEN:
                return head, time.monotonic()
            if event.kind == sse.DONE:
                return head, None
        raise EngineFailed(f"{engine.url} closed the stream before the first token")


async def _unless_lost(engine: Engine, work: Awaitable[T]) -> T:
    """`work` (a call up to the engine's first token), unless the engine is ejected first (dead or
    stalled: gateway/engines.py): then the call is dropped (the engine, should it wake, sees the
    disconnect and aborts) and EngineFailed moves the request to another engine at once."""
    task = asyncio.ensure_future(work)
    lost = asyncio.ensure_future(engine.lost())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait({task})  # its connection closed before the next engine is tried
        log.warning("engine ejected while a request waited for its first token; moving it", extra={
            "engine": engine.url})  # fmt: skip
        raise EngineFailed(f"{engine.url} was ejected (dead or stalled) before the first token")
    finally:
        lost.cancel()
        if not task.done():
            task.cancel()


async def with_retries(
    attempts: int,
    first: Engine,
    pick_next: Callable[[set[str]], Awaitable[Engine | None]],
    run: Callable[[Engine], Awaitable],
):
    """run(engine) on `first`, then on other engines while it raises EngineFailed. The failures
    whose blame was deferred count against their engines once one engine succeeds."""
    tried: set[str] = set()
    engine: Engine | None = first
    failures: list[EngineFailed] = []
    for attempt in range(attempts):
        if engine is None:
            break
        tried.add(engine.url)
        try:
            result = await run(engine)
        except EngineFailed as exc:
            failures.append(exc)
            if attempt == attempts - 1:
                break
            log.warning("engine failed before the first token; trying another", extra={"error": str(exc)})
            engine = await pick_next(tried)
            continue
        _blame(failures)
        return result
    last = failures[-1] if failures else None
    if failures and all(f.busy for f in failures):
        raise APIError(
            429, f"every engine tried has a full queue ({last}); retry shortly", type="rate_limit_error",
            code="engine_queue_full", headers={"Retry-After": "1"},
        )  # fmt: skip
    if len(tried) == 1:  # one engine: nothing to tell the request's fault from the engine's
        _blame(failures)
    elif all(f.blame is not None for f in failures):  # two engines at least, alike
        raise APIError(
            500,
            f"the request failed on each of the {len(tried)} engines tried, so it is taken for the cause, "
            f"not the engines ({last}); check it, or report it with its x-request-id",
            type="internal_error",
            code="request_failed_on_every_engine",
        )
    raise APIError(
        503,
        f"no engine could serve the request ({last})",
        type="service_unavailable",
        code="engines_unavailable",
        headers={"Retry-After": "2"},
    )


def _blame(failures: list[EngineFailed]) -> None:
    for failed in failures:
        if failed.blame is not None:
            failed.blame()


def _error_type(event: sse.Event) -> str | None:
    err = event.chunk.get("error") if event.chunk else None
    return err.get("type") if isinstance(err, dict) else None
