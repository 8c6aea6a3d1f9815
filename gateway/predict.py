"""Latency predictions for one request on one engine, from its polled load plus what this gateway
has sent it since (gateway/engines.py): what admission and routing decide on.

- TTFT: (prefill tokens queued there + this request's tokens that engine does not hold) / the
  engine's measured prefill rate. A cache miss costs its tokens here.
- ITL: the engine's decode step with one more sequence than it runs and queues, over the context
  its sequences hold plus the prompts joining them and this one, extrapolated along the
  per-sequence and per-context-token growth the engine fits (engine/decode_fit.py).

Both are 0 while the engine has measured nothing: no evidence against it.

- LoRA: a request on an adapter also waits for its adapter to be in one of the engine's slots
  (`adapter_cost_s`): nothing when it is active there, one swap into a free slot, two when every
  slot is taken. That cost is added to the TTFT, so it trades against queues and cache misses in
  the same seconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvharbor.gateway.engines import Engine

# Seconds an engine takes to bring a LoRA adapter from memory into one of its slots: 12-13 ms for a
# rank-16 adapter on all seven projections of SmolLM2 (18.6 MiB, float32), measured by
# benchmarks/lora.py on the 2-core AMD EPYC; rounded up for larger models and busier machines.
LORA_SWAP_S = 0.02


class AdapterSlot(enum.Enum):
    """Where a request's adapter stands on an engine, best first (the router prefers in this order)."""

    ACTIVE = "active"  # in one of its slots (or a request this gateway sent there will put it in one)
    FREE_SLOT = "free_slot"  # not loaded, but a slot is free: one swap in
    SWAP = "swap"  # every slot taken: another adapter must make room


def adapter_slot(engine: Engine, adapter: str) -> AdapterSlot:
    if adapter in engine.active_adapters:
        return AdapterSlot.ACTIVE
    return AdapterSlot.FREE_SLOT if engine.lora_free_slots > 0 else AdapterSlot.SWAP


def adapter_cost_s(engine: Engine, adapter: str | None) -> float:
    """Predicted seconds before `adapter` can run on `engine` (0 for the base model or an active
    adapter): one swap into a free slot; two when every slot is taken, since the adapter it evicts
    (LRU: in use lately) is swapped back in for its next request, and its queued requests wait
    for a slot meanwhile."""
    if adapter is None:
        return 0.0
    slot = adapter_slot(engine, adapter)
    return {AdapterSlot.ACTIVE: 0.0, AdapterSlot.FREE_SLOT: LORA_SWAP_S, AdapterSlot.SWAP: 2 * LORA_SWAP_S}[slot]


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


def predict(
    engine: Engine, prompt_tokens: int, held_blocks: int, block_size: int, adapter: str | None = None
) -> Prediction:
    """TTFT and ITL of a request on `engine` (`adapter`: its LoRA adapter's name, None for the base)."""
    uncached = uncached_tokens(prompt_tokens, held_blocks, block_size)
    ttft = predict_ttft_s(engine.waiting_prefill_tokens, uncached, engine.prefill_tokens_per_s)
    return Prediction(ttft + adapter_cost_s(engine, adapter), engine.predicted_itl_s(prompt_tokens))
