"""Latency predictions for one request on one engine, from its polled load plus what this gateway
has sent it since (gateway/engines.py): what admission and routing decide on.

- TTFT: (prefill tokens queued there + this request's tokens that engine does not hold) / the
  engine's measured prefill rate. A cache miss costs its tokens here.
- ITL: the engine's decode step with one more sequence than it runs and queues, extrapolated
  along the per-sequence growth the engine fits (engine/core.py's EngineStats).

Both are 0 while the engine has measured nothing: no evidence against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvharbor.gateway.engines import Engine


def predict_ttft_s(waiting_prefill_tokens: int, uncached_tokens: int, prefill_tokens_per_s: float) -> float:
    if prefill_tokens_per_s <= 0:
        return 0.0  # not measured yet: no evidence against admitting
    return (waiting_prefill_tokens + uncached_tokens) / prefill_tokens_per_s


def uncached_tokens(prompt_tokens: int, held_blocks: int, block_size: int) -> int:
    return max(0, prompt_tokens - held_blocks * block_size)


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    itl_s: float

    def better_than(self, other: Prediction, slo_itl_s: float) -> bool:
        """Better TTFT with an ITL no worse or within the ITL SLO, or better ITL with a TTFT no
        worse. The ITL side is loose because decode steps measured on two engines sharing cores
        are noisy (an idle engine's few steps once read twice a busy one's); a TTFT is never given
        up for an ITL, so a prefix hit is not traded for a small decode gain."""
        if self.ttft_s < other.ttft_s and self.itl_s <= max(other.itl_s, slo_itl_s):
            return True
        return self.itl_s < other.itl_s and self.ttft_s <= other.ttft_s


def predict(engine: Engine, prompt_tokens: int, held_blocks: int, block_size: int) -> Prediction:
    uncached = uncached_tokens(prompt_tokens, held_blocks, block_size)
    ttft = predict_ttft_s(engine.waiting_prefill_tokens, uncached, engine.prefill_tokens_per_s)
    return Prediction(ttft, engine.predicted_itl_s())
