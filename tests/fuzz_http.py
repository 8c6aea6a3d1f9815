"""Helpers for tests/test_fuzz_http.py: one HTTP surface (the gateway, the engine server, the KV
cache service) reached in-process over ASGI or over a real socket, a per-request time bound, the
rule every answer must keep (status < 500, or 503 with Retry-After), a tally of the cases each
surface ran, and the hand-made hostile inputs.

Everything asynchronous runs on one event loop in a background thread (`LoopThread`): the apps'
asyncio objects (queues, Redis clients) stay on the loop they were first used on, whether a request
came over ASGI or through the uvicorn server that the same loop runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 20.0  # the bound on any single request: past it, the request "hung"


class LoopThread:
    """An asyncio loop in a daemon thread; `run(coro, timeout)` from the test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = REQUEST_TIMEOUT_S) -> Any:
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop)
        try:
            return future.result(timeout + 5)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UvicornInLoop:
    """The app on a real uvicorn server (as common/http_server.py configures it), on `loop`."""

    def __init__(self, loop: LoopThread, app: Any) -> None:
        import uvicorn

        from kvharbor.common.http_server import bind_listeners, uvicorn_config

        self.loop = loop
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, "127.0.0.1", self.port)
        config.lifespan = "off"  # the tests build the app's state themselves
        self.server = uvicorn.Server(config)
        sockets = bind_listeners("127.0.0.1", self.port, None)
        self.task = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=sockets), loop.loop)
        deadline = time.monotonic() + 20
        while not self.server.started:
            if self.task.done():
                self.task.result()
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True  # stalled connections (the slow-body cases) must not hold shutdown
        with contextlib.suppress(Exception):
            self.task.result(15)


# -- the rule and the tally ----------------------------------------------------------------------------


def acceptable(status: int, headers: httpx.Headers | dict) -> bool:
    """Status < 500, or 503 with Retry-After (a deliberate "come back later")."""
    if status < 500:
        return True
    return status == 503 and any(k.lower() == "retry-after" for k in headers)


@dataclass
class Tally:
    """Cases per (surface, class), statuses per surface, and every bad answer seen."""

    cases: Counter = field(default_factory=Counter)
    statuses: dict[str, Counter] = field(default_factory=dict)
    seconds: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, surface: str, kind: str, status: int | str) -> None:
        with self.lock:
            self.cases[(surface, kind)] += 1
            self.statuses.setdefault(surface, Counter())[status] += 1

    def table(self) -> str:
        surfaces = sorted({s for s, _ in self.cases})
        kinds = sorted({k for _, k in self.cases})
        width = max([len(k) for k in kinds] + [10])
        head = f"{'class':<{width}} " + " ".join(f"{s:>9}" for s in surfaces)
        lines = ["fuzz cases per surface (tests/test_fuzz_http.py)", head, "-" * len(head)]
        for kind in kinds:
            lines.append(f"{kind:<{width}} " + " ".join(f"{self.cases[(s, kind)]:>9}" for s in surfaces))
        lines.append("-" * len(head))
        totals = " ".join(f"{sum(n for (s2, _), n in self.cases.items() if s2 == s):>9}" for s in surfaces)
        lines.append(f"{'total':<{width}} {totals}")
        for s in surfaces:
            codes = ", ".join(f"{code}: {n}" for code, n in sorted(self.statuses[s].items(), key=lambda kv: str(kv[0])))
            lines.append(f"{s} statuses: {codes}")
        return "\n".join(lines)


TALLY = Tally()


class BadAnswer(AssertionError):
    pass


@dataclass
class Surface:
    """One HTTP surface: `asgi` (in-process; None for a real process) and `url` (a real server)."""

    name: str
    loop: LoopThread
    url: str
    asgi: Any = None  # the ASGI app, when in-process
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request (the API key)
    body_paths: tuple[str, ...] = ()  # POST paths that take a JSON body
    templates: dict[str, dict] = field(default_factory=dict)  # a valid body per body path
    tally: Tally = field(default_factory=lambda: TALLY)

    clients: dict[bool, httpx.AsyncClient] = field(default_factory=dict)

    def client(self, over_http: bool = False) -> httpx.AsyncClient:
        """One client per way in, reused (a new client per request costs more than the request)."""
        over_http = over_http or self.asgi is None
        if over_http not in self.clients:
            timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
            # No keep-alive: a server that closes a connection after an error would otherwise make the
            # next request on it fail in the client (a stale pooled connection), not in the server.
            limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
            if over_http:
                self.clients[over_http] = httpx.AsyncClient(base_url=self.url, timeout=timeout, limits=limits)
            else:
                transport = httpx.ASGITransport(app=self.asgi, raise_app_exceptions=False)
                client = httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=timeout)
                self.clients[over_http] = client
        return self.clients[over_http]

    def close(self) -> None:
        for client in self.clients.values():
            with contextlib.suppress(Exception):
                self.loop.run(client.aclose(), 10)
        self.clients.clear()

    def send(
        self,
        kind: str,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        headers: Any = None,
        params: Any = None,
        over_http: bool = False,
        default_headers: bool = True,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> httpx.Response:
        """One request, bounded by `timeout`; raises BadAnswer for a 5xx (save 503 + Retry-After)
        or for no answer in time. `headers`: a dict or a list of (name, value) pairs (bytes allowed)."""
        pairs: list[tuple[Any, Any]] = list(self.headers.items()) if default_headers else []
        if headers:
            given = list(headers.items()) if isinstance(headers, dict) else list(headers)
            names = {(n.decode() if isinstance(n, bytes) else n).lower() for n, _ in given}
            pairs = [(n, v) for n, v in pairs if n.lower() not in names] + given

        async def go() -> httpx.Response:
            return await self.client(over_http).request(method, path, content=content, headers=pairs, params=params)

        what = f"{method} {path} headers={_show(pairs)} body={_show(content)}"
        try:
            resp = self._answer(kind, what, go(), timeout)
        except httpx.TransportError as exc:
            self.tally.count(self.name, kind, "dropped")
            closed = f"the connection closed without an answer ({exc!r})"
            raise BadAnswer(f"{self.name} {kind}: {closed} to {what}") from None
        self._judge(kind, resp.status_code, resp.headers, f"{what} -> {resp.text[:500]}")
        return resp

    def send_raw(
        self,
        kind: str,
        method: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> tuple[int | str, dict[str, str]]:
        """The same over a raw socket to `url`, bytes as given (no client-side checks), with the
        surface's own headers first; a server that closes without answering counts as "closed"."""
        pairs = [(k.encode(), v.encode()) for k, v in self.headers.items()]
        names = {n.lower() for n, _ in headers}
        pairs = [(n, v) for n, v in pairs if n.lower() not in names] + list(headers)
        what = f"raw {method} {path} headers={_show(pairs)} body={_show(body)}"
        status, got = self._answer(kind, what, raw_request(self.url, method, path, pairs, body), timeout)
        self._judge(kind, status, got, what)
        return status, got

    def _answer(self, kind: str, what: str, request: Any, timeout: float) -> Any:
        """Await one request's coroutine within `timeout`, timed; no answer in time is a hang."""
        started = time.monotonic()
        try:
            return self.loop.run(request, timeout)
        except TimeoutError:
            self.tally.count(self.name, kind, "hang")
            raise BadAnswer(f"{self.name} {kind}: no answer within {timeout:.0f}s to {what}") from None
        finally:
            with self.tally.lock:
                self.tally.seconds[self.name] += time.monotonic() - started

    def _judge(self, kind: str, status: int | str, headers: Any, what: str) -> None:
        """Count the answer; a 5xx (save 503 + Retry-After) is a BadAnswer."""
        self.tally.count(self.name, kind, status)
        if isinstance(status, int) and not acceptable(status, headers):
            raise BadAnswer(f"{self.name} {kind}: {status} for {what}")

    def post_json(self, kind: str, path: str, body: Any, **kw: Any) -> httpx.Response:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = kw.pop("headers", None) or {"content-type": "application/json"}
        return self.send(kind, "POST", path, content=raw, headers=headers, **kw)


def _show(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def check_all(
    surface: Surface, kind: str, cases: list[tuple[str, str, bytes, dict | None]], concurrency: int = 1
) -> list[str]:
    """Send each (label, path, body, headers) case, `concurrency` at a time; the failures' messages
    (empty: all acceptable)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(case: tuple[str, str, bytes, dict | None]) -> str | None:
        label, path, body, headers = case
        try:
            surface.send(kind, "POST", path, content=body, headers=headers or {"content-type": "application/json"})
        except BadAnswer as exc:
            return f"[{label}] {exc}"
        return None

    if concurrency <= 1:
        results = [one(case) for case in cases]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, cases))
    return [r for r in results if r is not None]


# -- hand-made hostile inputs --------------------------------------------------------------------------

PLACEHOLDER = "__FUZZ_VALUE__"


def with_token(template: dict, path: tuple, token: str) -> bytes:
    """`template` as JSON with the value at `path` (keys / list indexes, made where missing)
    replaced by the raw JSON text `token` (so NaN, Infinity, 1e999 and 400-digit integers go
    through as written)."""
    doc = _set(json.loads(json.dumps(template)), path, PLACEHOLDER)
    return json.dumps(doc).replace(json.dumps(PLACEHOLDER), token).encode()


def _set(node: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    step, rest = path[0], path[1:]
    if isinstance(step, int):
        items = list(node) if isinstance(node, list) else []
        items += [None] * (step + 1 - len(items))
        items[step] = _set(items[step], rest, value)
        return items
    fields = dict(node) if isinstance(node, dict) else {}
    fields[step] = _set(fields.get(step), rest, value)
    return fields


# Raw JSON number tokens: out of every range, out of int64, floats that overflow, and the literals
# Python's json accepts (NaN, Infinity) though JSON does not.
NUMBER_TOKENS = [
    "-1",
    "0",
    str(2**31),
    str(2**63),
    str(2**64),
    str(-(2**63) - 1),
    "1" + "0" * 400,  # a 401-digit integer
    "1e308",
    "-1e308",
    "1e999",  # inf when parsed
    "1e-400",  # 0.0 when parsed
    "5e-324",  # the smallest double: 0.0 as float32
    "1e-300",
    "NaN",
    "Infinity",
    "-Infinity",
    "1.5",
    "true",
    '"7"',
]

BAD_UNICODE_STRINGS = [
    "\\ud800",  # a lone high surrogate (as a JSON escape)
    "\\udfff",  # a lone low surrogate
    "ok\\udc80ok",
    "\\udbff\\udbff",  # two highs: no pair
    "\\u0000",  # NUL: valid Unicode, but worth a look
]

# Valid Unicode that is not ASCII (or not printable): fine in a body, but not in an HTTP header,
# where a request id may end up.
ODD_TEXT = ["\u65e5\u672c\u8a9e", "caf\xe9", "\U0001f642", "\u2028", "\x7f", "a\tb", " ", "\u200b"]

BAD_UTF8_BYTES = [
    b"\xff",
    b"\xc3",  # a truncated 2-byte sequence
    b"\xed\xa0\x80",  # a surrogate encoded as if it were a character (CESU-8)
    b"\xc0\xaf",  # an overlong '/'
    b"\xf4\x90\x80\x80",  # past U+10FFFF
]


def string_paths(template: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Paths of every string value and every dict (for a new key) in `template`."""
    if isinstance(template, str):
        yield prefix
    elif isinstance(template, dict):
        for key, value in template.items():
            yield from string_paths(value, (*prefix, key))
    elif isinstance(template, list):
        for i, value in enumerate(template):
            yield from string_paths(value, (*prefix, i))


def invalid_unicode_cases(path: str, template: dict) -> list[tuple[str, str, bytes, dict | None]]:
    cases = []
    for where in string_paths(template):
        for bad in BAD_UNICODE_STRINGS:
            cases.append((f"{'.'.join(map(str, where))}={bad}", path, with_token(template, where, f'"{bad}"'), None))
        for raw in BAD_UTF8_BYTES:
            token = b'"x' + raw + b'x"'
            body = with_token(template, where, PLACEHOLDER).replace(PLACEHOLDER.encode(), token)
            cases.append((f"{'.'.join(map(str, where))}=bytes {raw!r}", path, body, None))
    for i, text in enumerate(ODD_TEXT):  # valid text; the request id as well (unique: engines refuse reuse)
        for where in [*string_paths(template), ("request_id",)]:
            value = f"{text}-{i}-{len(cases)}" if where == ("request_id",) else text
            cases.append((f"{'.'.join(map(str, where))}={text!r}", path, with_token(template, where, json.dumps(value)),
                          None))  # fmt: skip
    # A bad key, and a bad body outside any string.
    doc = json.dumps(template).encode()
    cases.append(("key \\ud800", path, doc[:-1] + b', "\\ud800": 1}', None))
    cases.append(("bytes outside strings", path, doc[:-1] + b" \xff}", None))
    cases.append(("BOM + body", path, b"\xef\xbb\xbf" + doc, None))
    cases.append(("UTF-16 body", path, json.dumps(template).encode("utf-16"), None))
    return cases


def deep_cases(path: str, template: dict) -> list[tuple[str, str, bytes, dict | None]]:
    cases = []
    for depth in (500, 10_000):
        arrays = "[" * depth + "]" * depth
        objects = '{"a":' * depth + "1" + "}" * depth
        cases.append((f"body = {depth} arrays", path, arrays.encode(), None))
        cases.append((f"body = {depth} objects", path, objects.encode(), None))
        for key in template:
            cases.append((f"{key} = {depth} arrays", path, with_token(template, (key,), arrays), None))
        cases.append((f"new field = {depth} objects", path, with_token(template, ("fuzz_extra",), objects), None))
        if "messages" in template:  # ChatMessage allows extra fields: they reach the chat template
            where = ("messages", 0, "fuzz_extra")
            cases.append((f"messages.0.extra = {depth} arrays", path, with_token(template, where, arrays), None))
            cases.append((f"messages.0.content = {depth} arrays", path,
                          with_token(template, ("messages", 0, "content"), arrays), None))  # fmt: skip
    return cases


def header_cases(template_body: bytes) -> list[tuple[str, list[tuple[bytes, bytes]]]]:
    """(label, extra headers) cases: one 64 KiB header, many headers, odd bytes in values."""
    big = b"a" * (64 << 10)
    many = [(f"x-fuzz-{i}".encode(), b"v" * 20) for i in range(2000)]
    return [
        ("64 KiB x-fuzz", [(b"x-fuzz", big)]),
        ("64 KiB x-request-id", [(b"x-request-id", big)]),
        ("64 KiB authorization", [(b"authorization", b"Bearer " + big)]),
        ("64 KiB traceparent", [(b"traceparent", big)]),
        ("64 KiB content-type", [(b"content-type", b"application/json; x=" + big)]),
        ("2000 headers", many),
        ("2000 x-request-id", [(b"x-request-id", b"r%d" % i) for i in range(2000)]),
        ("latin-1 x-request-id", [(b"x-request-id", "caf\xe9".encode("latin-1"))]),
        ("UTF-8 x-request-id", [(b"x-request-id", "\u65e5\u672c".encode())]),
        ("NBSP x-request-id", [(b"x-request-id", b"a\xa0b")]),
        ("high bytes x-request-id", [(b"x-request-id", bytes(range(0x80, 0x100)))]),
        ("latin-1 authorization", [(b"authorization", "Bearer \xe9\xe9".encode("latin-1"))]),
        ("bad traceparent", [(b"traceparent", b"00-zz-yy-01"), (b"tracestate", b"=" * 5000)]),
        ("content-length too small", [(b"content-length", str(max(1, len(template_body) // 2)).encode())]),
        ("negative content-length", [(b"content-length", b"-5")]),
        ("huge content-length", [(b"content-length", str(2**70).encode())]),
        ("content-encoding gzip", [(b"content-encoding", b"gzip")]),
        ("expect 100-continue", [(b"expect", b"100-continue")]),
    ]


def content_type_cases(template: dict) -> list[tuple[str, bytes, dict | None]]:
    """(label, body, headers) with the wrong Content-Type or a body that is not JSON."""
    doc = json.dumps(template).encode()
    boundary = "fuzzboundary"
    multipart = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nx\r\n--{boundary}--\r\n'
    ).encode()
    cases: list[tuple[str, bytes, dict | None]] = []
    for ctype in (
        None,
        "text/plain",
        f"multipart/form-data; boundary={boundary}",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
        "application/json; charset=utf-16",
        "application/octet-stream",
        "application/xml",
        "*/*",
        "",
        "application/json, text/plain",
    ):
        headers = {} if ctype is None else {"content-type": ctype}
        cases.append((f"JSON as {ctype!r}", doc, headers))
    json_headers = {"content-type": "application/json"}
    for label, body in (
        ("empty body", b""),
        ("form body", b"model=x&prompt=hi"),
        ("multipart body", multipart),
        ("null", b"null"),
        ("a list", b"[]"),
        ("a string", b'"hi"'),
        ("a number", b"1"),
        ("truncated JSON", doc[: len(doc) // 2]),
        ("two documents", doc + doc),
        ("trailing garbage", doc + b" x"),
        ("binary", bytes(range(256))),
        ("NUL bytes", b"\x00" * 64),
        ("duplicate keys", doc[:-1] + b", " + doc[1:]),
        ("XML", b"<?xml version='1.0'?><a/>"),
    ):
        cases.append((label, body, json_headers))
    multipart_type = {"content-type": f"multipart/form-data; boundary={boundary}"}
    cases.append(("multipart body as multipart", multipart, multipart_type))
    return cases


async def raw_request(
    url: str, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> tuple[int | str, dict[str, str]]:
    """One HTTP/1.1 request written byte for byte (Connection: close); (status, headers) of the
    final answer, 1xx skipped, or ("closed", {}) when the server hangs up without one."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), limit=4 << 20)
    try:
        head = [f"{method} {path} HTTP/1.1".encode(), f"Host: {host}:{port}".encode(), b"Connection: close"]
        if not any(n.lower() in (b"content-length", b"transfer-encoding") for n, _ in headers):
            head.append(b"Content-Length: %d" % len(body))
        head += [n + b": " + v for n, v in headers]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        while True:
            try:
                status_line = await reader.readline()
            except ConnectionError:
                return "closed", {}
            if not status_line:
                return "closed", {}
            fields: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                fields[name.strip().lower()] = value.strip()
            status = int(status_line.split()[1])
            if status >= 200:
                return status, fields
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


# -- the slow body: raw sockets, since a client library sends the whole body before it reads -----------


async def slow_body(url: str, path: str, headers: dict[str, str], body: bytes, pattern: str, bound_s: float) -> tuple:
    """POST `body` to `url` + `path`, declaring its full length, but send it slowly:
    pattern "stall": a third of it in 10 trickles, then nothing; "drip": one byte every 0.2 s.
    Returns (status line or None, seconds until the server answered or closed; None if it did neither
    within `bound_s`)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), limit=4 << 20)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    writer.write(head.encode())
    await writer.drain()
    started = time.monotonic()

    async def feed() -> None:
        if pattern == "stall":
            part = body[: len(body) // 3]
            step = max(1, len(part) // 10)
            for i in range(0, len(part), step):
                writer.write(part[i : i + step])
                await writer.drain()
                await asyncio.sleep(0.05)
            await asyncio.sleep(3600)
        else:
            for i in range(len(body) - 1):  # never the last byte
                writer.write(body[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.2)
            await asyncio.sleep(3600)

    feeder = asyncio.create_task(feed())
    try:
        line = await asyncio.wait_for(reader.readline(), bound_s)
        return (line.decode("latin-1").strip() or None), time.monotonic() - started
    except TimeoutError:
        return None, None
    except (ConnectionError, OSError):
        return "connection reset", time.monotonic() - started
    finally:
        feeder.cancel()
        with contextlib.suppress(BaseException):
            await feeder
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
