"""What the engine returns: one RequestOutput per user request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvharbor.engine.core_io import Failure
from kvharbor.engine.request import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # What changed since the previous RequestOutput of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: Failure | None = None  # set when finish_reason is "error": why, and whose fault
    embedding: list[float] | None = None  # a pooling request's vector (engine/pooling.py), not normalized
