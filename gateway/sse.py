"""An engine's SSE stream, one line at a time, each parsed once into what it is by its fields (not
by how the engine happens to serialize): a token, the usage chunk, an error event, the end, or
anything else (a role-only delta, a finish reason, a blank or comment line). The relay forwards
`line` unchanged and settles usage, TPM and slots from the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvharbor.common.openai_api import error_body

TOKEN, USAGE, ERROR, DONE, OTHER = "token", "usage", "error", "done", "other"


@dataclass(frozen=True)
class Event:
    line: str  # as the engine sent it
    kind: str  # TOKEN | USAGE | ERROR | DONE | OTHER
    chunk: dict[str, Any] | None = None  # the data line's JSON object

    @property
    def usage(self) -> dict[str, Any] | None:
        usage = self.chunk.get("usage") if self.chunk else None
        return usage if isinstance(usage, dict) else None

    @property
    def error_message(self) -> str:
        err = self.chunk.get("error") if self.chunk else None
        message = err.get("message") if isinstance(err, dict) else err
        return str(message)[:500] if message else "the engine sent an error event"


def parse(line: str) -> Event:
    if not line.startswith("data:"):
        return Event(line, OTHER)
    data = line[5:].strip()
    if data == "[DONE]":
        return Event(line, DONE)
    try:
        chunk = json.loads(data)
    except ValueError:
        return Event(line, OTHER)
    if not isinstance(chunk, dict):
        return Event(line, OTHER)
    choices = chunk.get("choices")
    if "error" in chunk and not choices:
        return Event(line, ERROR, chunk)
    if isinstance(choices, list) and any(_has_text(c) for c in choices):
        return Event(line, TOKEN, chunk)
    if not choices and isinstance(chunk.get("usage"), dict):
        return Event(line, USAGE, chunk)
    return Event(line, OTHER, chunk)


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return bool(choice.get("text"))
    return bool(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"))


def error_line(message: str, type_: str = "service_unavailable", code: str | None = None) -> str:
    """An OpenAI-shaped error event, as the relay sends when the engine's stream breaks or times out."""
    return "data: " + json.dumps(error_body(message, type_, code=code))
