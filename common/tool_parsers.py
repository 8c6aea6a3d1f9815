"""How each model family writes tool calls in its output, by vLLM's `--tool-call-parser` names
(common/model_families.py picks one per family), so a kvharbor engine reads the same calls a vLLM
server of that family would:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, after any text
    llama3_json  the whole output: {"name": ..., "parameters": {...}} (Llama 3.1+), several joined
                 by ";", optionally after <|python_tag|>
    mistral      text, then [TOOL_CALLS] and a JSON array of {"name", "arguments"}, or (v11+)
                 [TOOL_CALLS]name[ARGS]{...} per call
    pythonic     the whole output: [get_weather(city="Paris"), ...] (Llama 3.2/4, Gemma), or a
                 ```tool_code fenced call (Gemma's examples)

Each parse returns (content, calls); an output that does not parse as calls stays text. `opens`
are what begin calls anywhere (text before them is content), `starts` what begin them only as the
output's first characters: a stream holds back what could still become either.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Parsed = tuple[str | None, list[dict[str, Any]]]
HERMES = "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str, bool], Parsed]  # (text, closed_only: the output was cut) -> (content, calls)
    opens: tuple[str, ...] = ()
    starts: tuple[str, ...] = ()

    def call_start(self, text: str) -> int:
        """Where calls begin in `text` (len(text) if nowhere yet)."""
        head = len(text) - len(text.lstrip())
        if any(text.startswith(s, head) for s in self.starts):
            return 0
        found = [i for i in (text.find(o) for o in self.opens) if i >= 0]
        return min(found, default=len(text))

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` (with no call in it yet) could still begin one."""
        stripped = text.lstrip()
        if stripped and any(s.startswith(stripped) for s in self.starts):
            return len(text)
        for k in range(min(max(map(len, self.opens), default=1) - 1, len(text)), 0, -1):
            if any(o.startswith(text[-k:]) for o in self.opens):
                return k
        return 0


def _calls_of(items: Any, key: str = "arguments") -> list[dict[str, Any]] | None:
    """Tool calls of decoded {"name", arguments-or-parameters} objects; None if any is not one."""
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get(key, item.get("parameters", item.get("arguments", {})))
        if not isinstance(args, dict | str):
            return None
        calls.append(tool_call(item["name"], args))
    return calls


# -- hermes ----------------------------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of OpenAI's message.tool_calls: arguments as a JSON string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}




_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)
_CLOSED_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def parse_hermes(text: str, closed_only: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style calls in `text`: (the text before the first call or the whole text, calls).
    A last block with no closing tag counts, unless `closed_only` (an output cut short)."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in (_CLOSED_BLOCK if closed_only else _BLOCK).findall(text, start):
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, TypeError, KeyError):
            return text, []  # not calls after all: the text stands as it is
        if not isinstance(name, str) or not isinstance(args, dict | str):
            return text, []
        calls.append(tool_call(name, args))
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


# -- llama3_json -------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"
_SPACE = re.compile(r"\s*")


def parse_llama3_json(text: str, closed_only: bool = False) -> Parsed:
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, items, i = json.JSONDecoder(), [], 0
    while True:
        try:
            item, i = decoder.raw_decode(body, i)
        except ValueError:
            if closed_only and items:
                break  # cut short: the objects it completed
            return text, []
        items.append(item)
        i = _SPACE.match(body, i).end()
        if i == len(body):
            break
        if body[i] != ";":
            return text, []
        i = _SPACE.match(body, i + 1).end()
        if i == len(body):
            break
    calls = _calls_of(items, "parameters")
    return (None, calls) if calls else (text, [])


# -- mistral ---------------------------------------------------------------------------------------

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def parse_mistral(text: str, closed_only: bool = False) -> Parsed:
    start = text.find(TOOL_CALLS)
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    parts = [p.strip() for p in text[start:].split(TOOL_CALLS) if p.strip()]
    calls: list[dict[str, Any]] | None = []
    for part in parts:
        if part.startswith("["):  # the JSON array form
            items = _json_prefix(part)
            found = _calls_of(items) if isinstance(items, list) else None
        elif ARGS in part:  # name[ARGS]{...}
            name, _, args = part.partition(ARGS)
            decoded = _json_prefix(args)
            found = _calls_of([{"name": name.strip(), "arguments": decoded}]) if isinstance(decoded, dict) else None
        else:
            found = None
        if found is None:
            if closed_only and calls:
                break
            return text, []
        calls.extend(found)
    return (content, calls) if calls else (text, [])


def _json_prefix(text: str) -> Any:
    try:
        return json.JSONDecoder().raw_decode(text.strip())[0]
    except ValueError:
        return None


# -- pythonic ----------------------------------------------------------------------------------------

_FENCE = re.compile(r"```(?:tool_code|python)?\s*\n?(.*?)\s*(?:```|$)", re.S)


def parse_pythonic(text: str, closed_only: bool = False) -> Parsed:
    body, content = text.strip(), None
    fence = body.find("```")
    if fence >= 0:
        match = _FENCE.match(body, fence)
        content, body = body[:fence].strip() or None, match.group(1) if match else ""
    body = body.removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return text, []
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        call = _python_call(node)
        if call is None:
            return text, []
        calls.append(call)
    return (content, calls) if calls else (text, [])


def _python_call(node: ast.AST) -> dict[str, Any] | None:
    """f(a=1, b="x") as a tool call: keyword arguments with literal values only."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except ValueError:
        return None
    if len(args) != len(node.keywords):
        return None
    return tool_call(node.func.id, args)


PARSERS: dict[str, ToolParser] = {
    p.name: p
    for p in (
        ToolParser(HERMES, parse_hermes, opens=(OPEN,)),
        ToolParser("llama3_json", parse_llama3_json, starts=("{", PYTHON_TAG)),
        ToolParser("mistral", parse_mistral, opens=(TOOL_CALLS,)),
        ToolParser("pythonic", parse_pythonic, opens=("```tool_code",), starts=("[", "<|python_start|>")),
    )
}


def parser(name: str) -> ToolParser:
    """The parser of vLLM name `name`; Hermes' for a name kvharbor does not parse."""
    return PARSERS.get(name, PARSERS[HERMES])
