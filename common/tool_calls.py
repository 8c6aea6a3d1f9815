"""Tool calling on the wire: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, what they
put in the prompt, the constraint they put on the output, and how an output becomes tool calls.

- `none`: the tools stay out of the prompt and the output is free text.
- `auto`: the tools go into the prompt (through the chat template when it takes `tools`, else as
  a Hermes-style system message), and `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
  blocks in the output become tool calls; text before them stays the message's content.
- `required`: the output is constrained to a JSON array of calls, each an object with a tool's
  `name` and `parameters` satisfying its schema (one call unless parallel_tool_calls, at most
  MAX_PARALLEL_CALLS).
- a named function: the output is constrained to that function's arguments.

Forced calls hold the arguments to the keys each schema lists (OpenAI's strict mode:
structured_outputs.closed_objects).

The gateway and the engine render prompts with the same functions, so both tokenize alike.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvharbor.common.field_error import FieldError
from kvharbor.common.structured_outputs import closed_objects
from kvharbor.common.tool_parsers import CLOSE, HERMES, OPEN, parser, tool_call

TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
# Calls one `required` answer may hold: a small greedy model repeats the same call until its
# context runs out (SmolLM2-135M did, 1,883 tokens of one call), and no caller wants more.
MAX_PARALLEL_CALLS = 16


class FunctionDef(BaseModel):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class CalledFunction(BaseModel):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    arguments: str | dict[str, Any] = "{}"  # OpenAI's: a JSON string; an object is taken too


class AssistantToolCall(BaseModel):
    """One of an assistant message's earlier tool calls, as a client sends its history back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class NamedFunction(BaseModel):
    name: Annotated[str, Field(pattern=TOOL_NAME)]


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """The chat request's tool fields (mixed into ChatCompletionRequest)."""

    model_config = ConfigDict(extra="ignore")

    tools: list[Tool] | None = None  # how many: RequestLimits.max_tools
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ToolFields:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tools must have distinct function names")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(
                "tool_choice",
                f"tool_choice names function {choice.function.name!r}, which is not in tools "
                f"({', '.join(names) or 'none given'})"
            )
        if choice == "required" and not names:
            raise FieldError("tool_choice", 'tool_choice "required" needs tools')
        return self

    def tool_mode(self) -> str:
        """none | auto | required | named: what the tools do to this request."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return "none"
        if isinstance(choice, NamedToolChoice):
            return "named"
        return choice or "auto"

    def tool_use(self, parser_name: str = HERMES) -> ToolUse:
        """What the tools make of this request's output (ToolUse); `parser_name`: how the model
        writes calls (its family's, common/model_families.py)."""
        mode = self.tool_mode()
        named = self.tool_choice.function.name if mode == "named" else None
        names = frozenset(t.function.name for t in self.tools or ())
        return ToolUse(mode, named, names, self.parallel_tool_calls, parser_name)

    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows the model (none for tool_choice "none")."""
        if self.tool_mode() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_spec(self) -> dict[str, Any] | None:
        """The output constraint of a forced call (required or named), as an engine spec."""
        mode = self.tool_mode()
        if mode == "named":
            fn = next(t.function for t in self.tools if t.function.name == self.tool_choice.function.name)
            return {"kind": "json", "value": closed_objects(fn.parameters)}
        if mode != "required":
            return None
        calls = [
            {"type": "object", "properties": {"name": {"const": t.function.name},
                                              "parameters": closed_objects(t.function.parameters)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools
        ]  # fmt: skip
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                 "maxItems": MAX_PARALLEL_CALLS if self.parallel_tool_calls else 1}  # fmt: skip
        return {"kind": "json", "value": array}


# -- prompts ----------------------------------------------------------------------------------------


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools as a system message, for chat templates that take no `tools` (Hermes' format,
    which Qwen2.5, Hermes and many fine-tunes were trained on)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to help with the user's request. The functions are "
        f"listed within <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a JSON object with the function's name and arguments "
        f'within {OPEN}{CLOSE} tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )


def messages_for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template_takes_tools: bool) -> list[dict[str, Any]]:  # fmt: skip
    """`messages` as a template without tool support can render them: an assistant's tool_calls
    become Hermes blocks in its content, a tool result is wrapped in <tool_response>, and the tools
    open the system message. A template that takes tools gets the messages as they are."""
    if template_takes_tools:
        return messages
    out = [_plain(m) for m in messages]
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    role, calls = message.get("role"), message.get("tool_calls")
    if role == "assistant" and calls:
        blocks = [
            f"{OPEN}\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}, ensure_ascii=False)
            + f"\n{CLOSE}"
            for c in calls
        ]  # fmt: skip
        text = "\n".join(filter(None, [_text(message.get("content")), *blocks]))
        return {"role": "assistant", "content": text}
    if role == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"}
    if message.get("content") is None:
        return {**message, "content": ""}
    return message


def _arguments(call: dict[str, Any]) -> Any:
    raw = call["function"].get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


# -- outputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools make of its output: the mode (none | auto | required | named),
    the named function, the functions offered, and whether several calls may come at once."""

    mode: str = "none"
    named: str | None = None
    names: frozenset[str] = frozenset()
    parallel: bool = True
    parser: str = HERMES  # how the model writes an `auto` call (common/tool_parsers.py, by family)


def parse_output(text: str, use: ToolUse, finished: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an output under `use`. `finished` False: max_tokens cut it, and
    only the calls it completed count (a `required` array's whole elements, `auto`'s closed
    blocks). An output that does not parse as calls of the offered functions stays content: a
    model may answer in words even when it could call, and a call an agent cannot run is none."""
    if use.mode == "named":
        return None, [tool_call(use.named, text)]
    if use.mode == "required":
        calls = _array_calls(text, finished)
        return (None, calls) if calls else (text, [])
    if use.mode == "auto":
        content, calls = parser(use.parser).parse(text, not finished)
        if not all(_runnable(c, use.names) for c in calls):
            return text, []
        return content, calls if use.parallel else calls[:1]
    return text, []


def _runnable(call: dict[str, Any], names: frozenset[str]) -> bool:
    """A call of an offered function, with a JSON object for arguments."""
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        return False
    return call["function"]["name"] in names and isinstance(args, dict)


def _array_calls(text: str, finished: bool) -> list[dict[str, Any]]:
    """The calls of a `required` answer (a JSON array of {name, parameters}); cut short, the
    elements it completed."""
    if finished:
        try:
            items = json.loads(text)
        except ValueError:
            return []
    else:
        items = _whole_elements(text)
    try:
        return [tool_call(c["name"], c["parameters"]) for c in items]
    except (TypeError, KeyError):
        return []


def _whole_elements(text: str) -> list[Any]:
    """The elements of a JSON array text that are complete, before where it was cut."""
    decoder, items = json.JSONDecoder(), []
    i = _SPACE.match(text).end()
    if not text.startswith("[", i):
        return []
    while True:
        i = _SPACE.match(text, i + 1).end()  # past "[" or ","
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return items
        items.append(item)
        i = _SPACE.match(text, i).end()
        if not text.startswith(",", i):
            return items


_SPACE = re.compile(r"\s*")
