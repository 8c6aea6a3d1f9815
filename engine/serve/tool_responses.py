"""Chat answers that call tools (common/tool_calls.py decides the mode): the whole message with
`tool_calls`, and a stream's deltas as OpenAI sends them (each call's id and name first, then its
arguments in fragments).

A named call streams its arguments as they are generated. `required` and `auto` calls are JSON
that can only be told apart from text once whole, so their deltas wait for the sample's end;
`auto` streams the text before a call as content as it comes, holding back only what could be
the start of a call in the model family's format (common/tool_parsers.py: a `<tool_call>` tag,
`[TOOL_CALLS]`, or an output that opens with `{` or `[`).
"""

from __future__ import annotations

from typing import Any

from kvharbor.common.tool_calls import ToolUse, parse_output
from kvharbor.common.tool_parsers import new_call_id, parser


def tool_message(text: str, finish: str | None, use: ToolUse) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish reason of a finished sample. An output cut by max_tokens
    keeps the calls it completed (finish "length" says the rest was cut; a named call: its
    arguments as far as they got); one that completed none stays text."""
    if finish not in ("stop", "length") and use.mode != "named":
        return {"role": "assistant", "content": text}, finish
    content, calls = parse_output(text, use, finished=finish == "stop")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls and finish == "stop" else finish


class ToolCallStream:
    """One choice's stream: turns text deltas into content and tool-call deltas."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.mode, self.named = use.mode, use.named
        self.format = parser(use.parser)
        self._text = ""  # everything generated so far
        self._sent = 0  # of it, how much went out as content (auto)
        self._opened = False  # named: the call's id and name went out

    def delta(self, text: str, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """The chunk delta for `text` (None: nothing to send yet) and the finish reason to send."""
        self._text += text
        if self.mode == "named":
            return self._named(text, finish)
        if finish is None:
            return self._content_so_far(), None
        message, reason = tool_message(self._text, finish, self.use)
        calls = message.get("tool_calls") or []
        delta: dict[str, Any] = {}
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            before = ""
            if self.mode == "auto":
                before = self._text[self._sent : max(self._sent, self.format.call_start(self._text))]
            if before.strip():
                delta["content"] = before
        else:
            delta["content"] = self._text[self._sent :]
        return delta, reason

    def _named(self, text: str, finish: str | None) -> tuple[dict[str, Any] | None, str | None]:
        reason = "tool_calls" if finish == "stop" else finish
        if not self._opened:
            self._opened = True
            fn = {"name": self.named, "arguments": text}
            return {"tool_calls": [{"index": 0, "id": new_call_id(), "type": "function", "function": fn}]}, reason
        if not text:
            return ({}, reason) if finish else (None, None)
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, reason

    def _content_so_far(self) -> dict[str, Any] | None:
        """auto: text before any tool call goes out at once, but for a tail that may open a tag."""
        if self.mode != "auto":
            return None
        start = self.format.call_start(self._text)
        end = start if start < len(self._text) else len(self._text) - self.format.held_back(self._text)
        if end <= self._sent:
            return None
        piece, self._sent = self._text[self._sent : end], end
        return {"content": piece}

