"""The wire API, a contract in common/: OpenAI's chat and completions requests, kvharbor's extension fields,
and OpenAI's error shape. The engine server and the gateway both parse requests with these models.

Extension fields, beyond OpenAI:
    vLLM's          ignore_eos, min_tokens, top_k, min_p, repetition_penalty, stop_token_ids,
                    include_stop_str_in_output, skip_special_tokens, return_token_ids
    kvharbor's      prompt_token_ids (already tokenized; the chat template is not applied again),
                    cache_salt, priority (higher first; < 0 may be shed), request_id,
                    kv_prefix_source ("local" | "shared": where already computed blocks may come from),
                    speculative (false: opt out of the engine's speculative decoding),
                    kv_transfer_params (P/D, vLLM's name: see KVTransferParams),
                    continued_text (a migrated stream's text the client has not had: it opens the output),
                    text_offset (completions: where the answer's text starts in the client's, for
                    logprobs' text_offset; a migrated stream's continuation goes on from the text streamed)
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvharbor.common import sampling_limits as lim
from kvharbor.common.field_error import FieldError
from kvharbor.common.sampling_limits import MAX_CONTINUED_TEXT, MAX_LOGPROBS
from kvharbor.common.structured_outputs import StructuredFields
from kvharbor.common.tool_calls import AssistantToolCall, ToolFields

# Integers a request carries are bounded where they are read, so none overflows the engine link's
# 64-bit integers, the block hash's int32 token ids (common/block_hash.py) or a tokenizer's u32.
INT32 = 2**31
TokenId = Annotated[int, Field(ge=0, lt=INT32)]
TokenCount = Annotated[int, Field(ge=0, lt=INT32)]


class APIError(Exception):
    """An error that reaches the client as OpenAI's error JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


# Request ids: the one rule for every HTTP edge (gateway and engine). An id travels back as the
# X-Request-Id header and into every log line, so it is printable ASCII and bounded.
MAX_REQUEST_ID = 256
# What the gateway keeps free of that for its own suffixes on an engine's id: ".<8 hex>" per
# admission and ".m<n>" per stream migration (gateway/call.py engine_rid).
GATEWAY_ID_SUFFIX = 16


def request_id(given: str | None, header: str | None, prefix: str) -> str:
    """A request's id: the body's `request_id`, else its X-Request-Id header, else a fresh
    `<prefix>-<hex>`. Raises APIError (400) for one that cannot go back as a header."""
    rid = given or header or f"{prefix}-{uuid.uuid4().hex}"
    if not (rid.isascii() and rid.isprintable()) or len(rid) > MAX_REQUEST_ID:
        raise APIError(
            400, f"request_id must be printable ASCII of at most {MAX_REQUEST_ID} characters", param="request_id"
        )
    return rid


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... pass through to the template

    role: Annotated[str, Field(min_length=1)]
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls, rendered into the prompt


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (unset fields left out). An assistant's
    earlier reasoning is taken under either name vLLM accepts, `reasoning` or `reasoning_content`,
    and given to the template as `reasoning_content` (the name templates read, Qwen3's among them)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if "reasoning" in d:
            d.setdefault("reasoning_content", d.pop("reasoning"))
        out.append(d)
    return out


class KVTransferParams(BaseModel):
    """P/D (gateway/pd_flow.py). Sent by the gateway, never by tenants (it strips them). Either a prefill
    for a decode engine (`do_remote_decode`: the engine runs the prompt, samples the first token and
    keeps the KV under a lease; its response carries the lease), or that prefill's continuation on a
    decode engine (`remote_*` and `first_token_id`: it pulls the KV, then decodes from that token)."""

    model_config = ConfigDict(extra="forbid")

    do_remote_decode: bool = False
    remote_host: Annotated[str, Field(min_length=1, max_length=255)] | None = None
    remote_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    # A lease key (the gateway's request id, up to 256 + 9 characters, and a nonce, + 17) signed
    # (+ 33): engine/kv/handoff_handles.py
    remote_handle: Annotated[str, Field(min_length=1, max_length=320)] | None = None
    first_token_id: TokenId | None = None

    @model_validator(mode="after")
    def _one_side(self) -> KVTransferParams:
        remote = (self.remote_host, self.remote_port, self.remote_handle, self.first_token_id)
        if self.do_remote_decode and any(v is not None for v in remote):
            raise ValueError("kv_transfer_params is a prefill (do_remote_decode) or its continuation, not both")
        if not self.do_remote_decode and any(v is None for v in remote):
            raise ValueError(
                "a continuation needs remote_host, remote_port, remote_handle and first_token_id "
                "(from the prefill engine's response)"
            )
        return self

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, exclude_defaults=True)


class SamplingFields(StructuredFields):
    """Fields shared by chat and completions; `sampling_kwargs()` maps them to the engine's names."""

    model: Annotated[str, Field(min_length=1)]
    n: Annotated[int, Field(ge=1)] = 1
    temperature: Annotated[float, Field(**lim.TEMPERATURE.field())] | None = None
    top_p: Annotated[float, Field(**lim.TOP_P.field())] | None = None
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None  # count and length: RequestLimits
    seed: Annotated[int, Field(ge=int(lim.SEED.low), le=int(lim.SEED.high))] | None = None
    presence_penalty: Annotated[float, Field(**lim.PRESENCE_PENALTY.field())] | None = None
    frequency_penalty: Annotated[float, Field(**lim.FREQUENCY_PENALTY.field())] | None = None
    logit_bias: dict[str, Annotated[float, Field(**lim.LOGIT_BIAS.field())]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    ignore_eos: bool = False
    min_tokens: TokenCount = 0
    top_k: Annotated[int, Field(ge=-1, lt=INT32)] | None = None
    min_p: Annotated[float, Field(**lim.MIN_P.field())] | None = None
    repetition_penalty: Annotated[float, Field(**lim.REPETITION_PENALTY.field())] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # each choice (each streamed delta) carries its token ids
    # kvharbor's extensions
    prompt_token_ids: list[TokenId] | None = None
    cache_salt: str | None = None
    priority: Annotated[int, Field(ge=-INT32, lt=INT32)] = 0
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID)] | None = None
    kv_prefix_source: Literal["local", "shared"] | None = None
    speculative: bool = True
    kv_transfer_params: KVTransferParams | None = None
    continued_text: Annotated[str, Field(max_length=MAX_CONTINUED_TEXT)] | None = None
    # A migrated stream: how many of the prompt's last tokens are its output so far (a structured
    # output's grammar walks them before the first new token).
    continued_tokens: TokenCount = 0

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit() and int(key) < INT32):
                raise ValueError(f"logit_bias keys must be token ids, got {key[:40]!r}")
        return bias

    def max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's SamplingParams (None means the engine default)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": self.max_new_tokens(),
            "min_tokens": self.min_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "seed": self.seed,
            "repetition_penalty": self.repetition_penalty or 1.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": self.num_logprobs(),
            "speculative": self.speculative,
            "continued_text": self.continued_text or "",
            "structured": self.structured_spec(),
            "continued_tokens": self.continued_tokens,
        }
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, lt=INT32)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, lt=INT32)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.tool_spec() is not None and self.structured_spec() is not None:
            message = "a forced tool call (tool_choice) constrains the output already: drop response_format"
            raise FieldError("response_format", message)
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if kwargs["structured"] is None:
            kwargs["structured"] = self.tool_spec()
        return kwargs

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput | None = None
    max_tokens: Annotated[int, Field(ge=1, lt=INT32)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    text_offset: TokenCount = 0  # kvharbor's: see the module docstring

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.prompt is None and self.prompt_token_ids is None:
            raise FieldError("prompt", "give a prompt (or prompt_token_ids)")
        if self.suffix is not None:
            raise FieldError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of must equal n (no server-side ranking)")
        if self.echo and self.logprobs is not None:
            raise FieldError("echo", "echo with logprobs is not supported (no prompt logprobs)")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: text or token ids (prompt_token_ids wins)."""
        if self.prompt_token_ids is not None:
            return [self.prompt_token_ids]
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # one prompt given as token ids
        return list(p or [])


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: text, texts, token ids, or lists of token ids (their count: max_prompts)."""

    model: Annotated[str, Field(min_length=1)]
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, lt=INT32)] | None = None
    user: str | None = None
    # kvharbor's extensions, as on chat and completions
    cache_salt: str | None = None
    priority: Annotated[int, Field(ge=-INT32, lt=INT32)] = 0
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID)] | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> EmbeddingRequest:
        inputs = self.inputs()
        if not inputs or any(len(i) == 0 for i in inputs):
            raise FieldError("input", "input must not be empty, nor any of its items")
        return self

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a prompt's token ids."""
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(x, int) for x in given):
            return [list(given)]  # one input given as token ids
        return list(given)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's shape; lora_int_id is accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None
