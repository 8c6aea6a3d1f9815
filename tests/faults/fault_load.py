"""The fault suite's bounded load and its table (tests/faults/test_faults.py).

Each request is a streamed chat through one of the gateways, read as raw SSE so that every way it
can end is told apart:
- ok: `[DONE]` after tokens, no error event;
- failed before its first token: an HTTP error status, or an error event before any token, on
  every gateway tried (a refused connection moves to the other gateway, as a Service would);
- broken: an error event, or a cut connection, after its first token;
- hung: not ended within its deadline (none allowed).
Every request loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

ROWS: list[dict] = []  # one per fault, printed at the end of the session (tests/conftest.py)


@dataclass
class Outcome:
    kind: str  # ok | failed_before_first_token | broken | hung
    text: str = ""
    usage: dict = field(default_factory=dict)
    detail: str = ""


async def stream_chat(gateways: list[str], key: str, body: dict, deadline_s: float, first: int = 0) -> Outcome:
    """One streamed chat; a refused connection tries the next gateway."""
    try:
        return await asyncio.wait_for(_stream_chat(gateways, key, body, first), timeout=deadline_s)
    except TimeoutError:
        return Outcome("hung", detail=f"not ended within {deadline_s:g} s")


async def _stream_chat(gateways: list[str], key: str, body: dict, first: int) -> Outcome:
    headers = {"Authorization": f"Bearer {key}"}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    last = "no gateway tried"
    for i in range(len(gateways)):
        url = gateways[(first + i) % len(gateways)]
        pieces: list[str] = []
        usage: dict = {}
        try:
            async with (
                httpx.AsyncClient(timeout=httpx.Timeout(120, connect=2)) as http,
                http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r,
            ):
                if r.status_code != 200:
                    return Outcome("failed_before_first_token", detail=f"{r.status_code} {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        kind = "ok" if pieces else "failed_before_first_token"
                        return Outcome(kind, "".join(pieces), usage, "" if pieces else "no token")
                    if not line.startswith("data: "):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        kind = "broken" if pieces else "failed_before_first_token"
                        return Outcome(kind, "".join(pieces), usage, str(chunk["error"].get("message"))[:200])
                    usage = chunk.get("usage") or usage
                    pieces += [c.get("delta", {}).get("content") or "" for c in chunk.get("choices") or []]
                return Outcome("broken" if pieces else "failed_before_first_token", "".join(pieces), detail="no [DONE]")
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
            if pieces:
                return Outcome("broken", "".join(pieces), usage, repr(exc)[:200])
            last = repr(exc)[:200]  # this gateway is gone: the next one
        except httpx.HTTPError as exc:
            return Outcome("broken" if pieces else "failed_before_first_token", "".join(pieces), detail=repr(exc)[:200])
    return Outcome("failed_before_first_token", detail=last)


async def run_load(gateways: list[str], key: str, bodies: list[dict], concurrency: int, deadline_s: float):
    """Every body once, `concurrency` at a time, alternating the gateways first tried."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, body: dict) -> Outcome:
        async with gate:
            return await stream_chat(gateways, key, body, deadline_s, first=i)

    return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def row(fault: str, outcomes: list[Outcome], recovery_s: float, moved: float, refused: dict | None = None) -> dict:
    """`refused`: requests the engines refused as their own fault meanwhile, by reason (the gateways'
    kvharbor_gateway_requests_refused_total)."""
    counts = {k: sum(o.kind == k for o in outcomes) for k in ("ok", "failed_before_first_token", "broken", "hung")}
    moved = max(0, int(moved))  # a gateway restarted meanwhile counts from 0 again
    said = ", ".join(f"{reason} {int(n)}" for reason, n in sorted((refused or {}).items()) if n > 0) or "0"
    entry = {"fault": fault, "sent": len(outcomes), **counts, "moved": moved, "recovery_s": round(recovery_s, 1),
             "refused": said}  # fmt: skip
    ROWS.append(entry)
    return entry


def table(rows: list[dict]) -> str:
    head = ("fault", "sent", "ok", "failed before 1st token", "broken streams", "hung", "streams moved", "recovery (s)",
            "refused by engines (reason n)")  # fmt: skip
    keys = ("fault", "sent", "ok", "failed_before_first_token", "broken", "hung", "moved", "recovery_s", "refused")
    width = max(len(r["fault"]) for r in rows) + 2
    widths = [max(len(h), *(len(str(r[k])) for r in rows)) + 2 for k, h in zip(keys[1:], head[1:], strict=True)]
    lines = [f"{head[0]:<{width}}" + "".join(f"{h:>{w}}" for h, w in zip(head[1:], widths, strict=True))]
    for r in rows:
        cells = (f"{r[k]!s:>{w}}" for k, w in zip(keys[1:], widths, strict=True))
        lines.append(f"{r['fault']:<{width}}" + "".join(cells))
    return "\n".join(lines)


def wait_until(predicate, timeout: float, what: str) -> float:
    """Poll until true; the seconds it took. AssertionError past `timeout`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            if predicate():
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
