"""What goes into the engine core and what comes out: token ids, never text (and no torch, so
the API server, which only speaks to the core, does not load it).

The core (engine/core.py) takes NewRequests and reports CoreOutputs; the output processor
(engine/output_processor.py) turns those into RequestOutputs with text, in the same process
(offline LLM) or in the API server's (`kvharbor serve`, over the link as plain lists:
`to_wire`/`from_wire`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvharbor.engine.request import Logprob
from kvharbor.engine.sampling_params import SamplingParams


@dataclass
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    external_prefix: Any = None  # kv_offload.ExternalPrefix: blocks to load into the cache first
    hand_off: str | None = None  # P/D: a prefill's lease key; its KV is pinned for a decode engine (EngineCore)
    first_token: int | None = None  # P/D: the first token, sampled by the prefill engine
    lora: str | None = None  # the LoRA adapter to run it on (by name); None: the base model


class EngineDead(RuntimeError):
    """The engine core stopped on an unexpected error (or its process died); restart the server."""


class UnknownModel(ValueError):
    """A request for a model or adapter this engine does not serve (the API's 404)."""


class AdapterInUse(ValueError):
    """An adapter cannot be unloaded while requests use it (the API's 409)."""


class HandoffFailed(RuntimeError):
    """P/D: a hand-off's KV could not be loaded and --kv-load-failure-policy is fail; says why."""


# How the core process names an error to the API server (engine/core_process.py sends the kind,
# engine/core_client.py raises the class again); anything else is a ValueError (a 400).
ERROR_KINDS: dict[str, type[Exception]] = {
    "dead": EngineDead, "handoff": HandoffFailed, "unknown": UnknownModel, "conflict": AdapterInUse,
}  # fmt: skip


def error_kind(exc: BaseException) -> str:
    return next((kind for kind, cls in ERROR_KINDS.items() if isinstance(exc, cls)), "invalid")


@dataclass
class SampleDelta:
    """One sample's progress since its last report."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[Logprob] = field(default_factory=list)  # one per new token when asked for
    finish_reason: str | None = None  # "stop" (EOS or a stop token) | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id, when one ended it


@dataclass
class CoreOutput:
    """One user request's progress in a step: its samples that moved, and whether all are done."""

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None

    def to_wire(self) -> list:
        samples = [
            [s.index, s.new_token_ids, [_logprob_wire(lp) for lp in s.new_logprobs], s.finish_reason, s.stop_reason]
            for s in self.samples
        ]
        return [self.request_id, samples, self.finished, self.num_cached_tokens, self.error]

    @classmethod
    def from_wire(cls, data: list) -> CoreOutput:
        request_id, samples, finished, cached, error = data
        deltas = [
            SampleDelta(index, list(ids), [_logprob_from_wire(lp) for lp in lps], reason, stop)
            for index, ids, lps, reason, stop in samples
        ]
        return cls(request_id, deltas, finished, cached, error)


def _logprob_wire(lp: Logprob) -> list:
    return [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top]]


def _logprob_from_wire(data: list) -> Logprob:
    token, value, top = data
    return Logprob(token, value, [(t, v) for t, v in top])
