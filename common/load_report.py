"""The engine load report, a contract in common/: what `GET /load` answers, typed, in one place.

The engine builds it, `/metrics` renders it, the gateway routes and admits on it, the operator
scales on it. Fields are added here and nowhere else; a reader gets defaults for fields an older
engine does not send, and ignores fields it does not know.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any


class LoadReportError(ValueError):
    """A /load answer that is not a load report; the message names the field."""


@dataclass(frozen=True)
class LoadReport:
    model: str = ""
    instance_id: str = ""
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued for admission
    waiting_prefill_tokens: int = 0  # prompt tokens not computed yet, queued or mid-prefill
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # no user (cached or not)
    kv_blocks_cached: int = 0  # reusable by prefix
    prefill_tokens_per_s: float = 0.0  # measured (EWMA)
    decode_step_ms: float = 0.0  # measured (EWMA); 0 until the engine has run a few decode steps
    decode_batch: float = 0.0  # sequences in those decode steps (EWMA)
    decode_ms_per_seq: float = 0.0  # how a decode step grows per sequence (fitted; 0: not known yet)
    decode_context_tokens: float = 0.0  # context tokens those steps' sequences attended over (EWMA)
    decode_us_per_context_token: float = 0.0  # how a decode step grows per context token (fitted; 0: not known)
    context_tokens: int = 0  # tokens the running sequences hold now (prompt + output): their next step's context
    spec_acceptance_rate: float | None = None  # None: no speculation yet
    draining: bool = False
    # Heartbeats (DESIGN.md, busy is not dead): steps the engine core has run, and seconds since its
    # API server last heard from the core. Steps that stand still while requests wait or run, or a
    # silent core, is a stall; a late /load answer from a busy engine is not (gateway/engines.py).
    steps: int = 0
    core_silent_s: float = 0.0
    in_flight: int = 0  # requests the server holds open
    slo_requests: int = 0  # finished requests slo_attainment covers
    slo_attainment: float | None = None  # share of them that met TTFT and ITL; None without any
    weight_bytes: int = 0  # the model's weights as held (quantized ones at their own size)
    kv_bytes_per_token: int = 0  # KV bytes one token takes in the pool, every layer
    # What its KV blocks are (layout, KV dtype, weights: BlockFormat.tag): engines of one format
    # can use each other's blocks; "" from an engine that does not say
    kv_format: str = ""
    block_size: int = 0  # tokens per KV block: what prompts' block hashes are cut by (0: not reported)
    role: str = "both"  # P/D: both | prefill | decode (gateway/disagg.py)
    task: str = "generate"  # generate (chat, completions) | embed (/v1/embeddings): where the gateway routes what
    kv_transfer_port: int = 0  # where decode engines pull hand-offs from (0: none)
    kv_pinned_blocks: int = 0  # blocks held for hand-offs not yet confirmed
    kv_transfer_bytes_per_s: float = 0.0  # hand-off pulls into this engine, measured (EWMA); 0: none yet
    kv_transfer_age_s: float = 0.0  # seconds since a pull last measured that rate
    # LoRA (issue 18): adapters this engine can serve, name -> identity (common/lora.py); which of
    # them hold one of its `lora_slots` (adapters one step can run); their bytes in memory.
    lora_adapters: dict[str, str] = field(default_factory=dict)
    lora_active: tuple[str, ...] = ()
    lora_slots: int = 0  # 0: LoRA off
    lora_bytes: int = 0

    @property
    def lora_free_slots(self) -> int:
        return max(0, self.lora_slots - len(self.lora_active))

    @property
    def queue(self) -> int:
        return self.running + self.waiting

    def decode_step_s_at(self, sequences: int, context_tokens: float | None = None) -> float:
        """The predicted decode step (the inter-token latency) with this many sequences running,
        over `context_tokens` (None: as in the measured steps; each sequence's own, shared prefixes
        counted per sequence): the measured step, extrapolated along the fitted per-sequence and
        per-token growth; 0 when unmeasured. An engine that reports no context fit adds nothing."""
        if not self.decode_step_ms:
            return 0.0
        ms = self.decode_step_ms + self.decode_ms_per_seq * (sequences - self.decode_batch)
        if context_tokens is not None and self.decode_us_per_context_token:
            ms += self.decode_us_per_context_token / 1000 * (context_tokens - self.decode_context_tokens)
        return max(0.0, ms) / 1000

    @property
    def kv_free_fraction(self) -> float:
        """Free share of the pool (1.0 for an engine that reported no pool)."""
        return self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 1.0

    def with_server(self, **changes: Any) -> LoadReport:
        """The same report with the server's own fields (instance, drain, in flight, SLO) set."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["lora_active"] = list(self.lora_active)
        return {k: v for k, v in out.items() if v is not None or k not in _OPTIONAL}

    @classmethod
    def from_json(cls, data: Any) -> LoadReport:
        """Parse a /load answer; raises LoadReportError when it is not an object or a known field
        has the wrong type."""
        if not isinstance(data, dict):
            raise LoadReportError(f"/load must answer a JSON object, got {type(data).__name__}")
        values = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            values[f.name] = _checked(f.name, data[f.name], _TYPES[f.name])
        if not values:
            # NOTE: vLLM's GET /load answers {"server_load": N}. Read as a report of defaults, that
            # was an idle engine of block size 0: the gateway sent it everything.
            raise LoadReportError(
                f"/load answered none of a load report's fields (got {sorted(data)[:5]}): not a kvharbor "
                "engine; a vLLM server answers {\"server_load\": N} there"
            )
        return cls(**values)


_OPTIONAL = {"spec_acceptance_rate", "slo_attainment"}
_TYPES: dict[str, type] = {f.name: f.type for f in fields(LoadReport)}  # postponed: the annotation strings


def _checked(name: str, value: Any, annotation: Any) -> Any:
    kind = str(annotation)
    if value is None and "None" in kind:
        return None
    if kind.startswith("dict"):
        ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    elif kind.startswith("tuple"):
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    elif kind.startswith("str"):
        ok = isinstance(value, str)
    elif kind.startswith("bool"):
        ok = isinstance(value, bool)
    elif kind.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:  # float
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    if not ok:
        raise LoadReportError(f"/load field {name}={value!r} is not a valid {kind.split(' ')[0]}")
    return value
