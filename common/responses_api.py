"""The Responses API on the wire, a contract in common/: OpenAI's `POST /v1/responses` request and
the items a conversation is made of. The gateway reads requests with these models, translates
them to chat (gateway/responses_chat.py) and keeps conversations (gateway/response_store.py).

What kvharbor takes, in OpenAI's shapes:
    input           a string, or a list of items: messages (roles user, system, developer,
                    assistant; text parts), function_call, function_call_output, reasoning
    tools           function tools only (a hosted tool such as web_search is a 400 naming it)
    text.format     text, json_object, json_schema
    reasoning       accepted; a model without a reasoning parser ignores it
    store           true by default, as OpenAI's; previous_response_id continues a stored one
What it refuses with a 400 naming the field, rather than pretend: `background` (no job queue runs
responses apart from their request), `conversation` (use previous_response_id), `truncation:
"auto"` (a conversation that no longer fits is the client's to shorten), images and files.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from kvharbor.common import sampling_limits as lim
from kvharbor.common.field_error import FieldError
from kvharbor.common.openai_api import INT32
from kvharbor.common.tool_calls import TOOL_NAME

ID_CHARS = r"^[A-Za-z0-9_-]{1,128}$"
# OpenAI's metadata rule: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextContent(_Item):
    """A text part: `input_text` in what a client writes, `output_text` in an assistant's turn
    sent back, `reasoning_text` or `summary_text` in a reasoning item; refusals read as text."""

    type: Literal["input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text"]
    text: str = ""
    refusal: str | None = None

    def plain(self) -> str:
        return self.refusal if self.type == "refusal" and self.refusal is not None else self.text


def plain_text(value: str | list[TextContent]) -> str:
    """A string, or text parts joined: what a message's content or a call's output says."""
    return value if isinstance(value, str) else "".join(part.plain() for part in value)


class MessageItem(_Item):
    type: Literal["message"] = "message"
    id: Annotated[str, Field(pattern=ID_CHARS)] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]
    status: str | None = None

    def text(self) -> str:
        return plain_text(self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    id: Annotated[str, Field(pattern=ID_CHARS)] | None = None
    call_id: Annotated[str, Field(min_length=1, max_length=128)]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    arguments: str = "{}"
    status: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    id: Annotated[str, Field(pattern=ID_CHARS)] | None = None
    call_id: Annotated[str, Field(min_length=1, max_length=128)]
    output: str | list[TextContent]
    status: str | None = None

    def text(self) -> str:
        return plain_text(self.output)


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    id: Annotated[str, Field(pattern=ID_CHARS)] | None = None
    summary: list[TextContent] = Field(default_factory=list)
    content: list[TextContent] | None = None
    encrypted_content: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES = {"message": MessageItem, "function_call": FunctionCallItem,
              "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}  # fmt: skip


def read_item(raw: Any, where: str) -> InputItem:
    """One input item by its `type` (a message may leave it out, as OpenAI's easy form does).
    Raises FieldError naming `where` (and the part at fault) for anything else."""
    if not isinstance(raw, dict):
        raise FieldError(where, f"{where}: an input item is a JSON object")
    kind = raw.get("type", "message" if "role" in raw else None)
    cls = ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = ", ".join(ITEM_TYPES)
        raise FieldError(f"{where}.type", f"{where}.type: unknown input item type {str(kind)[:40]!r}; kvharbor "
                                          f"takes {known}")  # fmt: skip
    if kind == "message":
        _text_parts_only(raw.get("content"), f"{where}.content")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join([where, *(str(p) for p in first.get("loc", ()))])
        raise FieldError(field, f"{field}: {first.get('msg')}") from None


def _text_parts_only(content: Any, where: str) -> None:
    if not isinstance(content, list):
        return
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise FieldError(f"{where}.{i}.type", f"{where}.{i}.type: {str(kind)[:40]!r} is not served here: "
                                                  "kvharbor's models take text parts only (input_text)")  # fmt: skip


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=TOOL_NAME)]


class TextFormat(BaseModel):
    """`text.format`: OpenAI puts json_schema's fields beside its type (not under json_schema)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] = "response"
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise FieldError("text.format.schema", 'text.format type "json_schema" needs a schema')
        return self


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # verbosity: accepted, nothing to tune

    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. `input_items()` reads `input` into typed items (400 naming the item)."""

    model: Annotated[str, Field(min_length=1)]
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(pattern=ID_CHARS)] | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    conversation: Any = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=INT32)] | None = None
    temperature: Annotated[float, Field(**lim.TEMPERATURE.field())] | None = None
    top_p: Annotated[float, Field(**lim.TOP_P.field())] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # Accepted and without effect here: which extra fields to include (kvharbor's items carry what
    # they have), the prompt-cache key (prefix routing finds cached prefixes by their blocks), the
    # service tier, stream options.
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    _items: list[InputItem] = PrivateAttr(default_factory=list)  # `input`, read by _served
    _tools: list[FunctionTool] = PrivateAttr(default_factory=list)  # `tools`, read by _served

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} metadata pairs")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE}")  # fmt: skip
        return metadata

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        if self.background:
            raise FieldError("background", "background responses are not served by kvharbor: send the request "
                                           "without background (stream it to watch its progress)")  # fmt: skip
        if self.conversation is not None:
            raise FieldError("conversation", "conversation objects are not served by kvharbor: continue a "
                                             "stored response with previous_response_id")  # fmt: skip
        if self.truncation == "auto":
            raise FieldError("truncation", 'truncation "auto" is not served by kvharbor: a conversation that '
                                           "no longer fits the model's context is a 400; shorten it")  # fmt: skip
        if isinstance(self.input, str) and not self.input:
            raise FieldError("input", "input must not be empty")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise FieldError("input", "input must not be empty")
        # Read once, here: a hosted tool or a malformed item is a 400 now, not later.
        self._tools = self._read_tools()
        self._items = self._read_items()
        return self

    def input_items(self) -> list[InputItem]:
        return self._items

    def function_tools(self) -> list[FunctionTool]:
        return self._tools

    def _read_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [read_item(raw, f"input.{i}") for i, raw in enumerate(self.input)]

    def _read_tools(self) -> list[FunctionTool]:
        tools = []
        for i, raw in enumerate(self.tools or ()):
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind != "function":
                raise FieldError(f"tools.{i}.type", f"tools.{i}.type: {str(kind)[:40]!r} is not served here: "
                                                    "kvharbor runs function tools only")  # fmt: skip
            try:
                tools.append(FunctionTool.model_validate(raw))
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join([f"tools.{i}", *(str(p) for p in first.get("loc", ()))])
                raise FieldError(field, f"{field}: {first.get('msg')}") from None
        return tools
