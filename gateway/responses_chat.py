"""A Responses request as the chat request every engine already serves, and a chat answer as a
Response: the one translation, so only the gateway knows about Responses and it works over
kvharbor engines and vLLM pods alike.

A conversation is a list of items (common/responses_api.py). Its chat form:
    instructions                    a first system message (a stored turn's instructions are not
                                    carried into the next: OpenAI's rule)
    message                         a message of its role (developer reads as system)
    function_call                   a tool call of the assistant message before it (consecutive
                                    calls are one assistant turn)
    function_call_output            a tool message answering an earlier call (400 if none has its
                                    call_id)
    reasoning                       left out: chat templates drop earlier turns' reasoning
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvharbor.common.field_error import FieldError
from kvharbor.common.responses_api import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    read_item,
)


def new_id(prefix: str) -> str:
    """An unguessable id: a stored response is found by its id alone, within its tenant."""
    return f"{prefix}_{secrets.token_hex(24)}"


def chat_messages(instructions: str | None, items: list[InputItem], first_new: int) -> list[dict[str, Any]]:
    """The chat messages of a conversation; items from `first_new` on are this request's input
    (a 400 names them as input.<i>)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            fn = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": fn}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                where = f"input.{i - first_new}.call_id" if i >= first_new else "previous_response_id"
                raise FieldError(where, f"{where}: no function_call before it has call_id {item.call_id[:64]!r}")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def chat_request(req: ResponsesRequest, context: list[dict[str, Any]], items: list[InputItem]) -> dict[str, Any]:
    """The chat body of `req` continuing `context` (the stored items before it, already valid)."""
    before = [read_item(raw, "previous_response_id") for raw in context]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.instructions, before + items, len(before)),
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": req.stream,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}  # the usage of response.completed
    tools = req.function_tools()
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in tools]  # fmt: skip
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}  # fmt: skip
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        given = {k: v for k, v in schema.items() if v is not None}
        body["response_format"] = {"type": "json_schema", "json_schema": given}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("user", "user"), ("request_id", "request_id")):  # fmt: skip
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    return body


# A chat field's name in the Responses request it came from (for a 400 the chat check raised).
CHAT_TO_RESPONSES = {"messages": "input", "response_format": "text.format",
                     "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}  # fmt: skip


def responses_param(param: str | None) -> str | None:
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return CHAT_TO_RESPONSES.get(head, head) + dot + rest


# -- the answer ----------------------------------------------------------------------------------


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [part] if text or status == "completed" else []}  # fmt: skip


def function_call_item(call: dict[str, Any], status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    fn = call.get("function") or {}
    arguments = fn.get("arguments", "")
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call.get("id") or new_id("call"),
            "name": fn.get("name", ""), "status": status,
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}  # fmt: skip


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}  # fmt: skip


def reasoning_of(message: dict[str, Any]) -> str:
    """A chat message's reasoning, under either name engines use (vLLM's `reasoning`, older
    `reasoning_content`)."""
    return message.get("reasoning") or message.get("reasoning_content") or ""


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as output items: its reasoning, its text, then its tool calls."""
    items = []
    if reasoning := reasoning_of(message):
        items.append(reasoning_item(reasoning))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or ""))
    items.extend(function_call_item(c) for c in calls)
    return items


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage in the Responses shape (cached prompt tokens included)."""
    if not chat_usage:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    prompt, completion = int(chat_usage.get("prompt_tokens", 0)), int(chat_usage.get("completion_tokens", 0))
    reasoning = int((chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


@dataclass
class ResponseShape:
    """What a Response echoes of its request, and its identity: `render` makes the object at each
    stage of its life (in_progress, then completed, incomplete or failed)."""

    req: ResponsesRequest
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def render(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
               error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:  # fmt: skip
        req = self.req
        choice = req.tool_choice
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": req.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
            "tools": [{**t.model_dump(exclude_none=True), "strict": bool(t.strict)} for t in req.function_tools()],
            "truncation": "disabled", "usage": usage, "user": req.user, "metadata": req.metadata or {},
            "background": False,
        }  # fmt: skip

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response of a whole (unary) chat answer."""
        choice = (chat.get("choices") or [{}])[0]
        output = output_items(choice.get("message") or {})
        cut = choice.get("finish_reason") == "length"
        return self.render("incomplete" if cut else "completed", output, usage_of(chat.get("usage")),
                           incomplete="max_output_tokens" if cut else None)  # fmt: skip
