"""An engine's measured speed: the EWMAs its load report carries (prefill rate, decode step and
how a step grows), the speculation counts and the P/D pull rate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvharbor.engine.decode_fit import DecodeFit
from kvharbor.engine.scheduler import SchedulerPlan


@dataclass
class EngineStats:
    """Measured speed, as EWMAs (alpha 0.2): the load report's 'prefill tok/s' and 'decode step',
    the decode batch and context tokens those steps ran, and how a decode step grows per sequence
    and per context token (engine/decode_fit.py; 0 until each has varied), which the gateway
    extrapolates to predict inter-token latency. The decode figures are reported
    from MIN_DECODE_STEPS steps on: a first few steps (cold caches, a neighbour's burst) once made
    an idle engine look twice as slow as a busy one, and the gateway kept a burst off it."""

    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    decode_batch: float = 0.0
    decode_context: float = 0.0  # context tokens of a decode step's sequences (EWMA)
    decode_steps: int = 0
    steps: int = 0
    step_seconds: float = 0.0  # every step's time, summed (the denominator of the masking share)
    spec_verifications: int = 0  # speculative chunks verified
    spec_proposed: int = 0  # draft tokens scored
    spec_accepted: int = 0  # of those, accepted
    kv_transfer_bytes_per_s: float = 0.0  # P/D pulls into this engine (EWMA)
    kv_transfer_at: float = 0.0  # time.monotonic() of the last pull measured (0: none yet)
    fit: DecodeFit = field(default_factory=DecodeFit)

    def record(self, plan: SchedulerPlan, seconds: float) -> None:
        prefill = sum(c.num_tokens for c in plan.chunks if c.num_tokens > 1 and not c.draft)
        self.steps += 1
        self.step_seconds += seconds
        if prefill:
            rate = prefill / max(seconds, 1e-9)
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, rate)
            return
        batch, context = len(plan.chunks), sum(c.end for c in plan.chunks)
        self.decode_steps += 1
        self.decode_step_s = _ewma(self.decode_step_s, seconds)
        self.decode_batch = _ewma(self.decode_batch, float(batch))
        self.decode_context = _ewma(self.decode_context, float(context))
        self.fit.add(batch, context, seconds)

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.kv_transfer_bytes_per_s = _ewma(self.kv_transfer_bytes_per_s, nbytes / seconds)
            self.kv_transfer_at = time.monotonic()

    def kv_transfer_age_s(self) -> float:
        """Seconds since a pull last measured the rate: the gateway trusts an old measure less
        (gateway/disagg.py pull_rate), or a pessimistic one would keep hand-offs, and so any new
        measure, away for good."""
        return round(time.monotonic() - self.kv_transfer_at, 1) if self.kv_transfer_at else 0.0

    def decode_report(self) -> dict[str, float]:
        """The load report's decode fields, once there are enough steps to tell (else none)."""
        if self.decode_steps < MIN_DECODE_STEPS:
            return {}
        per_seq, per_token = self.fit.slopes()
        return {
            "decode_step_ms": round(self.decode_step_s * 1000, 2),
            "decode_batch": round(self.decode_batch, 2),
            "decode_ms_per_seq": round(per_seq * 1000, 3),
            "decode_context_tokens": round(self.decode_context, 1),
            "decode_us_per_context_token": round(per_token * 1e6, 4),
        }


MIN_DECODE_STEPS = 8


def _ewma(old: float, new: float) -> float:
    return new if not old else 0.8 * old + 0.2 * new
