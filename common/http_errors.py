"""OpenAI-shaped errors for every FastAPI app of kvharbor (engine, KV cache service, gateway).

`install_error_handlers` makes each failure leave as {"error": {...}} with its status: APIError as
raised, validation errors and malformed JSON as 400, unknown paths as 404, anything unexpected as
500 with the details only in the log. `on_error(path, status)` lets the app count them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvharbor.common.openai_api import APIError


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
