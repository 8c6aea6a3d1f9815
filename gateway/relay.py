"""One streamed answer on its way from an engine to the client, and everything it
settles when it ends, once, however it ends (done, engine broke, client left):

- each SSE line is parsed once (gateway/sse.py) and forwarded unchanged, except the usage chunk
  the gateway asked for and the client did not, and the token ids it asked for (to migrate);
- output tokens count toward the tenant's TPM as they flow, in batches of 16 to spare Redis, and
  the rest (the engine's usage when it sent one, else the tokens seen) when the stream ends;
- an engine that dies mid-stream (the connection breaks, it reports itself unavailable, or it
  goes `idle_s` without an event) does not end the stream when a `Continuation` is given: the
  prompt plus the tokens already streamed go to another engine, with the tokens left, and its
  events follow under the first engine's chunk id, its usage counted as one answer's
  (`migrate`). Past the migration limit, or with nowhere to go, the stream ends with an OpenAI
  error event and `[DONE]`; so does one that runs past its deadline;
- while it lives, the tenant's concurrency slot is renewed (`renew`), so a long stream keeps it;
- on close: the engine's connection (the engine sees it and aborts), then the caller's `settle`
  (slots, metrics, span) with what was seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
    migrations: int = 0  # times the stream moved to another engine
    migration_failed: bool = False  # an engine failed and the stream could not move on
    finished_here: bool = False  # an engine failed after its last token: the gateway ended the answer

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


class EngineLost(Exception):
    """The engine failed mid-stream (not the request): the stream may go on elsewhere."""


@dataclass
class Continuation:
    """How a stream goes on when its engine fails (gateway/flow.py makes one per streamed call).

    `open(ids, failure, delivered)` opens the stream again on another engine, from the prompt plus
    `ids` (the tokens already streamed; `delivered`: the text the client has of them, so the text
    the last engine held back can open the new output), read up to its first token; it raises
    (EngineFailed, APIError) when it cannot. `limit`: migrations allowed for the request.
    `max_tokens`: the request's cap, when it has one: a stream that broke with nothing left to
    generate just ends (finish "length")."""

    open: Callable[[list[int], str, str], Awaitable[EngineStream]]
    limit: int
    max_tokens: int | None
    prompt_tokens: int
    strip_token_ids: bool  # the gateway asked for them, the client did not


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
        continuation: Continuation | None = None,
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
        self.continuation = continuation
        self.ids: list[int] = []  # token ids streamed so far (when the engine sends them)
        self.pending = 0  # of those, the last ones whose text has not reached the client yet
        self.text = ""  # the answer's text sent to the client (choice 0: only n = 1 migrates)
        self.offset = 0  # tokens generated before the current engine's stream began
        self.identity: dict = {}  # the first chunk's id, object, created and model: a migrated stream keeps them
        self.head_token = stream.first_token is not None  # the current stream's first token is first_token
        self.aborted = False  # the last event was the engine aborting the request

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
        while True:
            try:
                async with contextlib.aclosing(self._timed()) as events:
                    async for event in events:
                        event = self._adjusted(event)
                        if event is None:
                            continue
                        if event.kind == sse.TOKEN:
                            if self.head_token:
                                self.head_token = False  # the head's first token: its time is first_token
                            else:
                                self.stats.chunk_times.append(time.monotonic())
                        yield event
                        if self.aborted:
                            self.aborted = False
                            raise EngineLost("the engine aborted the request (its drain timed out)")
                return
            except EngineLost as exc:
                failure, hard = str(exc), True
            except httpx.HTTPError as exc:
                failure, hard = f"the engine stream broke: {type(exc).__name__}", True
                log.warning("engine stream broke mid-way", extra={"error": repr(exc)})
            except StreamTimeout as exc:
                if exc.kind == "deadline" or not await self._migrate(str(exc), hard=False):
                    async for event in self._timed_out(exc):
                        yield event
                    return
                continue
            if not await self._migrate(failure, hard):
                self.stats.error = failure
                yield sse.parse(sse.error_line(failure + "; retry the request"))
                yield sse.parse("data: [DONE]")
                return

    async def _timed_out(self, exc: StreamTimeout) -> AsyncIterator[sse.Event]:
        self.stats.error, self.stats.timeout = str(exc), exc.kind
        log.warning("stream ended by a timeout; the engine's request is aborted", extra={"kind": exc.kind})
        yield sse.parse(sse.error_line(f"{exc}; the request was stopped", code=f"stream_{exc.kind}_timeout"))
        yield sse.parse("data: [DONE]")

    def _adjusted(self, event: sse.Event) -> sse.Event | None:
        """The event as the client sees it: token ids noted (and stripped unless asked for), and
        after a migration, the first engine's identity and the whole answer's usage. None: drop."""
        chunk = event.chunk
        if event.kind == sse.ERROR and _engine_unavailable(chunk) and self._can_migrate():
            raise EngineLost(f"the engine failed mid-stream: {event.error_message}")
        if chunk is None or event.kind == sse.ERROR:
            return event
        changed = False
        if _aborted(chunk) and self._can_migrate():
            # The gateway never aborts a stream it still relays, so the engine did (a drain past its
            # timeout): the text so far goes out, without the finish, and the rest comes from elsewhere.
            chunk["choices"][0]["finish_reason"] = None
            self.aborted = changed = True
        if not self.identity:
            self.identity = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        changed = self._note_ids(chunk) or changed
        if self.offset or self.stats.migrations:
            if _role_only(chunk):
                return None  # the client had its role chunk from the first engine
            chunk.update(self.identity)
            if event.usage is not None:
                _shift_usage(event.usage, self.offset)
            changed = True
        if not changed:
            return event
        return sse.Event("data: " + json.dumps(chunk, separators=(",", ":")), event.kind, chunk)

    def _note_ids(self, chunk: dict) -> bool:
        """Note the streamed token ids; True when they were stripped from the chunk."""
        stripped = False
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or "token_ids" not in choice:
                continue
            ids = choice["token_ids"] if isinstance(choice["token_ids"], list) else []
            self.ids += ids
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            self.text += text if isinstance(text, str) else ""
            has_text = bool(text)
            self.pending = 0 if has_text else self.pending + len(ids)
            if self.continuation is not None and self.continuation.strip_token_ids:
                del choice["token_ids"]
                stripped = True
        return stripped

    def _can_migrate(self) -> bool:
        c = self.continuation
        return c is not None and self.stats.migrations < c.limit

    async def _migrate(self, failure: str, hard: bool) -> bool:
        """Move the stream to another engine; False when it cannot (then it ends with an error)."""
        if not self._can_migrate():
            self.stats.migration_failed = self.continuation is not None
            return False
        assert self.continuation is not None
        done = self.ids[: len(self.ids) - self.pending]
        with contextlib.suppress(Exception):
            await self.stream.aclose()  # a stalled engine sees the disconnect when it wakes: it aborts
        left = None if self.continuation.max_tokens is None else self.continuation.max_tokens - len(done)
        if left is not None and left <= 0:
            self._finish_here(len(done))
            return True
        try:
            stream = await self.continuation.open(done, "hard" if hard else "stall", self.text)
        except Exception as exc:  # EngineFailed, APIError: nowhere to go
            log.warning("stream could not migrate", extra={"failure": failure, "error": str(exc)[:300]})
            self.stats.migration_failed = True
            return False
        self.stats.migrations += 1
        self.ids, self.pending, self.offset = list(done), 0, len(done)
        self.stream, self.head_token = stream, False
        log.info("stream migrated", extra={"failure": failure, "streamed_tokens": len(done)})
        return True

    def _finish_here(self, streamed: int) -> None:
        """The engine died after its last token: end the answer as it would have (no engine needed)."""
        assert self.continuation is not None
        chunk = {**self.identity, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        if self.identity.get("object") == "text_completion":
            chunk["choices"] = [{"index": 0, "text": "", "finish_reason": "length"}]
        prompt = self.continuation.prompt_tokens + streamed  # as a continuation would count it
        usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
        lines = ["data: " + json.dumps(chunk), "data: " + json.dumps({**self.identity, "choices": [], "usage": usage})]
        self.stream = _Finished([*lines, "data: [DONE]"])
        self.ids, self.pending, self.offset = self.ids[:streamed], 0, streamed
        self.stats.finished_here = True  # no engine took it over: counted apart from moves

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


class _Finished:
    """A stream's last events, made by the gateway (Continuation with no tokens left)."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    async def events(self) -> AsyncIterator[sse.Event]:
        for line in self.lines:
            yield sse.parse(line)

    async def aclose(self) -> None:
        pass


def _engine_unavailable(chunk: dict | None) -> bool:
    """An error event that says the engine, not the request, failed (its core died, it drains)."""
    err = chunk.get("error") if chunk else None
    return isinstance(err, dict) and err.get("type") == "service_unavailable"


def _aborted(chunk: dict) -> bool:
    choices = chunk.get("choices") or []
    return len(choices) == 1 and isinstance(choices[0], dict) and choices[0].get("finish_reason") == "abort"


def _role_only(chunk: dict) -> bool:
    choices = chunk.get("choices") or []
    return bool(choices) and all(
        isinstance(c, dict) and (c.get("delta") or {}).get("role") and not (c.get("delta") or {}).get("content")
        for c in choices
    )


def _shift_usage(usage: dict, offset: int) -> None:
    """The continuation's usage counted the streamed tokens as prompt: count them as output."""
    for key, delta in (("prompt_tokens", -offset), ("completion_tokens", offset)):
        if isinstance(usage.get(key), int):
            usage[key] += delta
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        details["cached_tokens"] = min(details["cached_tokens"], usage.get("prompt_tokens", 0))
