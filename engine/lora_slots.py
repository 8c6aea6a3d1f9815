"""Adapter slots and one step's LoRA deltas, applied to a flat batch in a few matmuls per projection.

`LoRASlots` holds --max-loras slots of --max-lora-rank, per layer and sub-projection (engine/lora.py):
`A [slots, R, in]` and `B [slots, R, out]`, zero where an adapter's rank or modules stop, so any
mix of ranks and targets runs through the same shapes. `LoRAStep` is one step's map from rows to
slots, and adds each row's delta to a projection's output:

- decode rows (the runner puts them first): one shrink over every used slot,
  `s = x A[:u]^T` [rows, u*R], a 0/1 mask that keeps each row's own slot, one expand
  `y += s B[:u]`. Three ops per sub-projection whatever the mix of adapters (the BGMV idea of
  punica / vLLM, in dense torch ops: on CPU a masked dense product beat a gather of per-row
  weights, which copies R x in floats per row and sub-projection per layer);
- prefill and speculative chunks (many rows, one adapter each): per run of rows on one slot,
  `y[rows] += (x[rows] A_slot^T) B_slot` (SGMV's segments), so long prompts pay for their own
  adapter only.

No loop runs over requests, and base-model rows cost nothing when no row of the step has an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvharbor.engine.lora import LoRAAdapter, SubShape, sub_shapes
from kvharbor.engine.model_arch import ModelArch

# Fused projection -> its PEFT sub-projections, in column order.
MODULES_OF = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}  # fmt: skip


class LoRASlots:
    def __init__(
        self, arch: ModelArch, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.shapes: dict[str, SubShape] = sub_shapes(arch)
        self.dtype = dtype

        def zeros(width: int) -> torch.Tensor:
            return torch.zeros(num_slots, max_rank, width, dtype=dtype, device=device)

        self.a = [{m: zeros(s.d_in) for m, s in self.shapes.items()} for _ in range(arch.num_layers)]
        self.b = [{m: zeros(s.d_out) for m, s in self.shapes.items()} for _ in range(arch.num_layers)]
        self.modules: list[frozenset[str]] = [frozenset()] * num_slots  # what each slot's adapter targets

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in (*self.a, *self.b) for t in layer.values())

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot`, replacing what was there (ranks below max_rank are zero-padded)."""
        for layer in (*self.a, *self.b):
            for t in layer.values():
                t[slot].zero_()
        r = adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            self.a[layer][module][slot, :r].copy_(a)
            self.b[layer][module][slot, :r].copy_(b.t())
        self.modules[slot] = adapter.modules

    def clear(self, slot: int) -> None:
        self.modules[slot] = frozenset()  # a slot no row maps to is never read; its bytes may stay


@dataclass
class LoRAStep:
    """Which rows of one step's batch run which slot: `apply` adds their deltas."""

    slots: LoRASlots
    decode_rows: int  # rows [0, decode_rows) go through the masked dense product
    used: int  # slots [0, used) that the decode rows may map to
    mask: torch.Tensor | None  # [decode_rows, used * R]; None: no decode row has an adapter
    segments: list[tuple[int, int, int]]  # (first row, end row, slot) of the other rows with an adapter
    modules: frozenset[str]  # sub-projections some row of the step adapts

    @classmethod
    def build(cls, slots: LoRASlots, row_slots: list[tuple[int, int]], decode_rows: int) -> LoRAStep | None:
        """`row_slots`: (tokens, slot or -1 for the base model) per chunk, in batch order, the
        first `decode_rows` chunks one token each. None when no chunk has an adapter."""
        if all(slot < 0 for _, slot in row_slots):
            return None
        decode = [slot for _, slot in row_slots[:decode_rows]]
        used = max(decode, default=-1) + 1
        mask = None
        if used:
            r = slots.max_rank
            cols = torch.arange(used, device=slots.a[0]["q_proj"].device).repeat_interleave(r)
            mask = (torch.tensor(decode, device=cols.device)[:, None] == cols[None, :]).to(slots.dtype)
        segments: list[tuple[int, int, int]] = []
        row = decode_rows
        for tokens, slot in row_slots[decode_rows:]:
            if slot >= 0 and segments and segments[-1][1] == row and segments[-1][2] == slot:
                segments[-1] = (segments[-1][0], row + tokens, slot)
            elif slot >= 0:
                segments.append((row, row + tokens, slot))
            row += tokens
        present = {s for _, s in row_slots if s >= 0}
        modules = frozenset().union(*(slots.modules[s] for s in present))
        return cls(slots, decode_rows, used, mask, segments, modules)

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's LoRA delta for `projection` (a fused output) of `layer`, x its input."""
        for module in MODULES_OF[projection]:
            if module not in self.modules:
                continue
            shape = self.slots.shapes[module]
            a, b = self.slots.a[layer][module], self.slots.b[layer][module]
            cols = slice(shape.offset, shape.offset + shape.d_out)
            if self.mask is not None:
                d, u = self.decode_rows, self.used
                shrunk = F.linear(x[:d], a[:u].view(-1, shape.d_in)).mul_(self.mask)
                y[:d, cols].addmm_(shrunk, b[:u].view(-1, shape.d_out))
            for start, end, slot in self.segments:
                y[start:end, cols].addmm_(F.linear(x[start:end], a[slot]), b[slot])
