"""A streamed chat answer as the Responses event sequence.

Every event carries `type` and a `sequence_number` counting from 0:
    response.created, response.in_progress                      the Response, in_progress
    response.output_item.added                                  an item opens (reasoning, message, function_call)
    response.reasoning_text.delta / .done                       a reasoning item's text
    response.content_part.added, response.output_text.delta / .done, response.content_part.done
                                                                a message's text
    response.function_call_arguments.delta / .done              a call's arguments
    response.output_item.done                                   the item, completed
    response.completed | response.incomplete | response.failed  the Response as it ended

The last event is sent only once `settle` (the store's write, gateway/responses.py) has taken the
Response: a stream that ended completed is retrievable. When the write fails, the stream ends in
response.failed instead, and no id that cannot be continued is handed out as completed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from kvharbor.common.openai_api import APIError
from kvharbor.gateway import sse
from kvharbor.gateway.responses_chat import (
    ResponseShape,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    usage_of,
)

log = logging.getLogger("kvharbor.gateway.responses")
# The Response -> None once stored, or the error that says why it was not
Settle = Callable[[dict[str, Any]], Awaitable[APIError | None]]


class _Open:
    """The item being streamed: its kind, index, id and what it has gathered."""

    def __init__(self, kind: str, index: int, item_id: str, call: dict[str, Any] | None = None) -> None:
        self.kind, self.index, self.id, self.call = kind, index, item_id, call or {}
        self.text = ""


class ResponseEvents:
    """Turns one chat stream's SSE lines into Responses events (`run`)."""

    def __init__(self, shape: ResponseShape, settle: Settle) -> None:
        self.shape, self.settle = shape, settle
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.error: dict[str, Any] | None = None
        self.ended = False

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    async def run(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        start = self.shape.render("in_progress", [])
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        try:
            async for text in lines:
                for line in text.split("\n\n"):
                    for out in self._chat_line(line.strip()):
                        yield out
            for out in self._close():
                yield out
            async for out in self._end():
                yield out
        finally:
            if not self.ended:  # the client left mid-stream: what it got is stored, as failed
                self.error = self.error or {"code": "client_closed", "message": "the client closed the stream"}
                await self._store_quietly(self._final("failed"))

    # -- chat lines ------------------------------------------------------------------------------

    def _chat_line(self, line: str) -> list[str]:
        event = sse.parse(line)
        if event.kind == sse.ERROR:
            err = event.chunk.get("error") if isinstance(event.chunk.get("error"), dict) else {}
            self.error = {"code": str(err.get("code") or err.get("type") or "engine_error"),
                          "message": event.error_message}  # fmt: skip
            return []
        chunk = event.chunk or {}
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage_of(chunk["usage"])
        out: list[str] = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                out += self._text("reasoning", reasoning)
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _text(self, kind: str, delta: str) -> list[str]:
        out = []
        if self.open is None or self.open.kind != kind:
            out += self._close()
            out += self._begin(kind)
        item = self.open
        item.text += delta
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                   content_index=0, delta=delta))  # fmt: skip
        else:
            out.append(self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                   content_index=0, delta=delta, logprobs=[]))  # fmt: skip
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out = []
        index = call.get("index", 0)
        if self.open is None or self.open.kind != "function_call" or self.open.call.get("index") != index:
            out += self._close()
            fn = call.get("function") or {}
            started = {"index": index, "id": call.get("id") or new_id("call"), "function": {"name": fn.get("name", "")}}
            out += self._begin("function_call", started)
        item = self.open
        arguments = (call.get("function") or {}).get("arguments") or ""
        if arguments:
            item.text += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                   output_index=item.index, delta=arguments))  # fmt: skip
        return out

    # -- items -----------------------------------------------------------------------------------

    def _begin(self, kind: str, call: dict[str, Any] | None = None) -> list[str]:
        index = len(self.output)
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        self.open = item = _Open(kind, index, new_id(prefix), call)
        self.output.append(self._item(item, "in_progress"))
        out = [self._event("response.output_item.added", output_index=index, item=self.output[index])]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                   content_index=0, part=part))  # fmt: skip
        return out

    def _item(self, item: _Open, status: str) -> dict[str, Any]:
        if item.kind == "reasoning":
            return reasoning_item(item.text, status, item.id)
        if item.kind == "message":
            return message_item(item.text, status, item.id)
        call = {"id": item.call["id"], "function": {"name": item.call["function"]["name"], "arguments": item.text}}
        return function_call_item(call, status, item.id)

    def _close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        done = self.output[item.index] = self._item(item, status)
        out = []
        if item.kind == "reasoning":
            out.append(self._event("response.reasoning_text.done", item_id=item.id, output_index=item.index,
                                   content_index=0, text=item.text))  # fmt: skip
        elif item.kind == "message":
            out.append(self._event("response.output_text.done", item_id=item.id, output_index=item.index,
                                   content_index=0, text=item.text, logprobs=[]))  # fmt: skip
            out.append(self._event("response.content_part.done", item_id=item.id, output_index=item.index,
                                   content_index=0, part=done["content"][0]))  # fmt: skip
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                   output_index=item.index, name=done["name"], arguments=item.text))  # fmt: skip
        out.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return out

    # -- the end ---------------------------------------------------------------------------------

    def _status(self) -> str:
        if self.error is not None:
            return "failed"
        return "incomplete" if self.finish == "length" else "completed"

    def _final(self, status: str) -> dict[str, Any]:
        return self.shape.render(status, self.output, self.usage, error=self.error if status == "failed" else None,
                                 incomplete="max_output_tokens" if status == "incomplete" else None)  # fmt: skip

    async def _end(self) -> AsyncIterator[str]:
        if self.error is None and self.finish is None:
            self.error = {"code": "stream_cut", "message": "the engine's stream ended before its answer did"}
        status = self._status()
        response = self._final(status)
        refusal = await self.settle(response)
        if refusal is not None and status != "failed":  # not stored: it must not read as continuable
            self.error = {"code": refusal.code, "message": refusal.message}
            status, response = "failed", self._final("failed")
        self.ended = True
        yield self._event(f"response.{status}", response=response)

    async def _store_quietly(self, response: dict[str, Any]) -> None:
        """Shielded: it runs while Starlette cancels the stream of a client that left."""
        with anyio.CancelScope(shield=True):
            try:
                await self.settle(response)
            except Exception as exc:  # the stream is gone; nothing is left to tell
                log.warning("could not store a stream the client left", extra={"error": repr(exc)})
