"""OpenAI-shaped errors for every FastAPI app of kvharbor (engine, KV cache service, gateway).

`install_error_handlers` makes each failure leave as {"error": {...}} with its status: APIError as
raised, validation errors and malformed JSON as 400, unknown paths as 404, anything unexpected as
500 with the details only in the log. `on_error(path, status)` lets the app count them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvharbor.common.openai_api import APIError
from kvharbor.common.unicode_check import unicode_problem


def install_error_handlers(
    app: FastAPI, log: logging.Logger, on_error: Callable[[str, int], None] = lambda path, status: None
) -> None:
    def respond(err: APIError, request: Request) -> JSONResponse:
        on_error(request.url.path, err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return respond(APIError(400, f"the request body is not valid JSON: {first.get('msg')}"), request)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        return respond(APIError(400, message, param=where or None), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(APIError(exc.status_code, str(exc.detail), type=kind), request)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return respond(APIError(500, "internal error; see the server log", type="internal_error"), request)


BODY_READ_TIMEOUT_S = 30.0  # seconds a POST body may take to arrive whole (408 after)


class BodyGuardMiddleware:
    """Pure ASGI: POST bodies under `prefixes` over `limit` bytes get 413, and bodies that are not
    valid Unicode text (common/unicode_check.py) get 400 `invalid_unicode`. The body is read (up
    to the limit) before the app runs, then replayed to it."""

    def __init__(self, app, limit: int, prefixes: tuple[str, ...] = ("/",), read_timeout: float | None = None) -> None:
        self.app = app
        self.limit = limit
        self.prefixes = prefixes
        self.read_timeout = BODY_READ_TIMEOUT_S if read_timeout is None else read_timeout

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        try:  # one deadline for the whole body: a client that stops, or drips, cannot hold it forever
            body = await asyncio.wait_for(self._read(scope, receive), self.read_timeout)
        except TimeoutError:
            message = f"the request body did not arrive within {self.read_timeout:g} s"
            await send_error(send, APIError(408, message, code="request_timeout", headers={"Connection": "close"}))
            return
        if body is None:
            await send_error(send, APIError(413, f"request body exceeds {self.limit} bytes", code="request_too_large"))
            return
        problem = unicode_problem(body)
        if problem is not None:
            await send_error(send, APIError(400, problem[0], param=problem[1], code="invalid_unicode"))
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, scope: dict, receive) -> bytes | None:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


async def send_error(send, err: APIError) -> None:
    """Answer an ASGI request with `err` as OpenAI's error JSON (for middleware)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
