"""What goes into the engine core and what comes out: token ids, never text (and no torch, so
the API server, which only speaks to the core, does not load it).

The core (engine/core.py) takes EngineRequests and reports CoreOutputs; the output processor
(engine/output_processor.py) turns those into RequestOutputs with text, in the same process
(offline LLM) or in the API server's (`kvharbor serve`). An EngineRequest is built once, at the
API edge (the API server, or LLMEngine's offline add_request), and crosses the core link as its
wire form (`to_wire`/`from_wire`, plain lists), as a CoreOutput comes back.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from kvharbor.engine.request import Logprob
from kvharbor.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVTransfer:
    """A request's P/D part (the API's kv_transfer_params, common/openai_api.py, plus the lease
    the API server draws): a prefill for a decode engine (`do_remote_decode`, its KV pinned under
    `lease`), or that prefill's continuation (`remote_*` and `first_token_id`: pull, then decode)."""

    do_remote_decode: bool = False
    lease: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_handle: str | None = None
    first_token_id: int | None = None

    @property
    def hand_off(self) -> str | None:
        """The lease key a prefill's KV is pinned under (None: not a hand-off prefill)."""
        return self.lease if self.do_remote_decode else None

    def to_wire(self) -> list:
        return [self.do_remote_decode, self.lease, self.remote_host, self.remote_port, self.remote_handle,
                self.first_token_id]  # fmt: skip

    @classmethod
    def from_wire(cls, data: list) -> KVTransfer:
        return cls(*data)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    lora: str | None = None  # the LoRA adapter to run it on (by name); None: the base model
    kv_prefix_source: str | None = None  # "shared": pull its prefix from the shared block store first
    transfer: KVTransfer | None = None  # P/D
    # Set in the core process, never on the wire: kv_offload.ExternalPrefix, blocks to load first;
    # a structured output's Guide, compiled off the engine thread (engine/structured/guides.py).
    external_prefix: Any = None
    guide: Any = None

    @property
    def hand_off(self) -> str | None:
        return self.transfer.hand_off if self.transfer else None

    @property
    def first_token(self) -> int | None:
        """P/D: the first token, sampled by the prefill engine (a continuation's)."""
        return self.transfer.first_token_id if self.transfer else None

    def to_wire(self) -> list:
        return [self.request_id, self.prompt_token_ids, self.params.to_wire(), self.priority, self.tenant,
                self.cache_salt, self.arrival_time, self.lora, self.kv_prefix_source,
                self.transfer.to_wire() if self.transfer else None]  # fmt: skip

    @classmethod
    def from_wire(cls, data: list) -> EngineRequest:
        """The request again, trusted as the API server built it; TypeError for malformed sampling
        parameters."""
        rid, ids, params, priority, tenant, salt, arrival, lora, source, transfer = data
        kv = KVTransfer.from_wire(transfer) if transfer is not None else None
        return cls(rid, list(ids), SamplingParams.from_wire(params), priority, tenant, salt, arrival, lora, source, kv)


class EngineDead(RuntimeError):
    """The engine core stopped on an unexpected error (or its process died); restart the server."""


class UnknownModel(ValueError):
    """A request for a model or adapter this engine does not serve (the API's 404)."""


class AdapterInUse(ValueError):
    """An adapter cannot be unloaded while requests use it (the API's 409)."""


class HandoffFailed(RuntimeError):
    """P/D: a hand-off's KV could not be loaded and --kv-load-failure-policy is fail; says why."""


class StructuredOutputError(ValueError):
    """A structured-output spec that does not compile or breaks a limit (engine/structured/)."""


class EngineError(RuntimeError):
    """The engine core failed while taking a request, not because of the request (the API's 500)."""


# How the core process names an error to the API server (engine/serve/core_process.py sends the kind,
# engine/serve/core_client.py raises the class again); anything else is a ValueError (a 400).
ERROR_KINDS: dict[str, type[Exception]] = {
    "dead": EngineDead, "handoff": HandoffFailed, "unknown": UnknownModel, "conflict": AdapterInUse,
    "structured": StructuredOutputError, "internal": EngineError,
}  # fmt: skip


def error_kind(exc: BaseException) -> str:
    return next((kind for kind, cls in ERROR_KINDS.items() if isinstance(exc, cls)), "invalid")


REQUEST_FAULT, ENGINE_FAULT = "request", "engine"


@dataclass(frozen=True)
class Failure:
    """Why a request ended with finish reason "error", and whose fault it was (DESIGN.md,
    failure attribution): the request's (REQUEST_FAULT: its own options, grammar or adapter failed
    it while the rest of its step went on; the API's 400, never retried elsewhere) or the
    engine's (ENGINE_FAULT: the step failed whatever ran in it; a 500, retried before the first
    token)."""

    message: str
    fault: str = ENGINE_FAULT

    def __str__(self) -> str:
        return self.message

    @property
    def requests_fault(self) -> bool:
        return self.fault == REQUEST_FAULT

    def to_wire(self) -> list:
        return [self.message, self.fault]

    @classmethod
    def from_wire(cls, data: list | None) -> Failure | None:
        return None if data is None else cls(*data)


def fault_message(exc: BaseException) -> str:
    """An exception as a request's error message: its type and text, bounded."""
    return f"{type(exc).__name__}: {exc}"[:500]


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
    error: Failure | None = None
    embedding: list[float] | None = None  # a pooling request's vector, with its last output

    def to_wire(self) -> list:
        samples = [
            [s.index, s.new_token_ids, [_logprob_wire(lp) for lp in s.new_logprobs], s.finish_reason, s.stop_reason]
            for s in self.samples
        ]
        error = self.error.to_wire() if self.error is not None else None
        return [self.request_id, samples, self.finished, self.num_cached_tokens, error, self.embedding]

    @classmethod
    def from_wire(cls, data: list) -> CoreOutput:
        request_id, samples, finished, cached, error, embedding = data
        deltas = [
            SampleDelta(index, list(ids), [_logprob_from_wire(lp) for lp in lps], reason, stop)
            for index, ids, lps, reason, stop in samples
        ]
        return cls(request_id, deltas, finished, cached, Failure.from_wire(error), embedding)


def _logprob_wire(lp: Logprob) -> list:
    return [lp.token_id, lp.logprob, [[t, v] for t, v in lp.top]]


def _logprob_from_wire(data: list) -> Logprob:
    token, value, top = data
    return Logprob(token, value, [(t, v) for t, v in top])


@dataclass(frozen=True)
class CoreStats:
    """The core's counters, as the API server's metrics read them (engine/serve/metrics.py): what the
    engine loop counts (prefix-cache lookups, aborts, speculation, LoRA swaps) and a snapshot of the
    core's CounterBoard (`board`: KV events, the shared store, P/D hand-offs, grammars). Crosses
    the core link whole, beside each load report; replaced, never changed."""

    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, found
    aborted: int = 0  # requests cancelled in flight
    spec_verifications: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    lora_swaps: int = 0
    lora_swap_seconds: float = 0.0
    step_seconds: float = 0.0  # engine steps' time, summed
    mask_seconds: float = 0.0  # of that, masking structured outputs' logits
    board: dict[str, dict[str, float]] = field(default_factory=dict)  # counter_board.CounterBoard.snapshot()

    def to_wire(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_wire(cls, data: list) -> CoreStats:
        return cls(*data)
