"""One streamed answer on its way from an engine to the client (DESIGN §5), and everything it
settles when it ends, once, however it ends (done, engine broke, client left):

- each SSE line is parsed once (gateway/sse.py) and forwarded unchanged, except the usage chunk
  the gateway asked for and the client did not;
- output tokens count toward the tenant's TPM as they flow, in batches of 16 to spare Redis, and
  the rest (the engine's usage when it sent one, else the tokens seen) when the stream ends;
- a stream that breaks after its first token ends with an OpenAI error event and `[DONE]`; so
  does one that runs past its deadline, or goes `idle_s` without an event (then closing the
  engine's connection aborts its request there);
- while it lives, the tenant's concurrency slot is renewed (`renew`), so a long stream keeps it;
- on close: the engine's connection (the engine sees it and aborts), then the caller's `settle`
  (slots, metrics, span) with what was seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import httpx

from kvharbor.common.logs import request_id_var
from kvharbor.gateway import sse

log = logging.getLogger("kvharbor.gateway.relay")
TPM_BATCH = 16


@dataclass
class StreamStats:
    """What the relay saw, for metrics, goodput and TPM."""

    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # each later token event's arrival
    usage: dict = field(default_factory=dict)  # the engine's usage, when it sent one
    error: str | None = None
    timeout: str | None = None  # "deadline" or "idle" when a timeout ended the stream

    @property
    def tokens_seen(self) -> int:
        return len(self.chunk_times) + (1 if self.first_token is not None else 0)


@dataclass
class EngineStream:
    """An engine's open stream, read up to its first token (EngineCaller.open_stream)."""

    response: httpx.Response
    head: list[sse.Event]  # the events read so far, the first token (or [DONE]) last
    rest: AsyncIterator[str]  # the lines after them
    first_token: float | None  # when the first token arrived

    async def events(self) -> AsyncIterator[sse.Event]:
        """Every event, the head first. Raises httpx.HTTPError if the stream breaks."""
        for event in self.head:
            yield event
        async for line in self.rest:
            yield sse.parse(line)

    async def aclose(self) -> None:
        await self.response.aclose()


class StreamTimeout(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # deadline | idle


class StreamRelay:
    def __init__(
        self,
        stream: EngineStream,
        request_id: str,
        include_usage: bool,
        debit: Callable[[int], Awaitable[None]],
        settle: Callable[[StreamStats], Awaitable[None]],
        *,
        deadline_s: float = float("inf"),
        idle_s: float = float("inf"),
        renew: Callable[[], Awaitable[None]] | None = None,
        renew_every_s: float = 60.0,
    ) -> None:
        """`debit(n)`: take n output tokens from the tenant's TPM; `settle(stats)`: the caller's
        own bookkeeping, run once when the stream ends; `renew()`: keep the request's slot, every
        `renew_every_s` while events flow. `deadline_s` counts from now, `idle_s` between events."""
        self.stream, self.request_id, self.include_usage = stream, request_id, include_usage
        self.debit, self.settle = debit, settle
        self.deadline = time.monotonic() + deadline_s
        self.deadline_s, self.idle_s = deadline_s, idle_s
        self.renew, self.renew_every_s = renew, renew_every_s
        self.renewed = time.monotonic()
        self.stats = StreamStats(first_token=stream.first_token)
        self.counted = 0  # output tokens already debited
        self.closed = False

    async def lines(self) -> AsyncIterator[str]:
        """The client's SSE lines (with their blank-line separators)."""
        request_id_var.set(self.request_id)  # the body streams after the handler returned: log under its id
        try:
            async for event in self._events():
                if event.usage is not None:
                    self.stats.usage = event.usage
                if event.kind == sse.USAGE and not self.include_usage:
                    continue  # the gateway asked for it; the client did not
                if event.kind == sse.ERROR:
                    self.stats.error = self.stats.error or event.error_message
                if not event.line:
                    continue
                yield event.line + "\n\n"
                if self.stats.tokens_seen - self.counted >= TPM_BATCH:
                    await self._debit(self.stats.tokens_seen)
                if self.renew is not None and time.monotonic() - self.renewed >= self.renew_every_s:
                    self.renewed = time.monotonic()
                    await self.renew()
        finally:
            await self.close()

    async def _timed(self) -> AsyncIterator[sse.Event]:
        """The engine's events, each within the idle timeout and the deadline (StreamTimeout)."""
        events = self.stream.events()
        try:
            while True:
                left = self.deadline - time.monotonic()
                try:
                    event = await asyncio.wait_for(anext(events), timeout=max(min(self.idle_s, left), 0.0))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if left <= self.idle_s:
                        message = f"the stream ran past its {self.deadline_s:g} s deadline"
                        raise StreamTimeout("deadline", message) from None
                    raise StreamTimeout("idle", f"no token for {self.idle_s:g} s") from None
                yield event
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()

    async def _events(self) -> AsyncIterator[sse.Event]:
        first = True
        try:
            async for event in self._timed():
                if event.kind == sse.TOKEN:
                    if first and self.stats.first_token is not None:
                        first = False  # the head's first token: its time is first_token
                    else:
                        self.stats.chunk_times.append(time.monotonic())
                yield event
        except httpx.HTTPError as exc:
            self.stats.error = f"the engine stream broke: {type(exc).__name__}"
            log.warning("engine stream broke mid-way", extra={"error": repr(exc)})
            yield sse.parse(sse.error_line(self.stats.error + "; retry the request"))
            yield sse.parse("data: [DONE]")
        except StreamTimeout as exc:
            self.stats.error, self.stats.timeout = str(exc), exc.kind
            log.warning("stream ended by a timeout; the engine's request is aborted", extra={"kind": exc.kind})
            yield sse.parse(sse.error_line(f"{exc}; the request was stopped", code=f"stream_{exc.kind}_timeout"))
            yield sse.parse("data: [DONE]")

    async def _debit(self, total: int) -> None:
        if total > self.counted:
            await self.debit(total - self.counted)
            self.counted = total

    async def close(self) -> None:
        """Settle once. Shielded: it runs while Starlette cancels a stream whose client left."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.aclose()  # the engine sees the disconnect and aborts
                await self._debit(int(self.stats.usage.get("completion_tokens", self.stats.tokens_seen)))
            finally:
                await self.settle(self.stats)
