"""Structured logs: one JSON object per line, with the request id of the request being served.

    setup_logging("INFO")
    with request_context("cmpl-123"):
        log.info("admitted", extra={"prompt_tokens": 17})
    -> {"ts": "...", "level": "INFO", "logger": "...", "msg": "admitted", "request_id": "cmpl-123", "prompt_tokens": 17}

Never pass secrets (API keys, Authorization headers, prompt text) in `extra`: everything in it is printed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar

request_id_var: ContextVar[str | None] = ContextVar("request_id", default=None)

# Attributes every LogRecord has; anything else came from `extra=` and is printed as a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            out["request_id"] = request_id
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and k != "request_id"})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO", json_format: bool = True) -> None:
    """Route kvharbor's (and uvicorn's) logs to stderr, as JSON lines unless `json_format` is False."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_format else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)
