"""Adapter slots and one step's LoRA deltas, applied to a flat batch in a few matmuls per projection.

`LoRASlots` holds --max-loras slots of --max-lora-rank, per layer (engine/lora.py): A as
`[sub-projections, slots, R, in]` per fused projection and B transposed as `[out, slots * R]` per
sub-projection, zero where an adapter's rank or modules stop, so any mix of ranks and targets runs
through the same shapes. `LoRAStep` is one step's map from rows to slots, and adds each row's
delta to a projection's output:

- decode rows (the runner puts them first): one shrink over every used slot (and, when every
  slot is used, over all of a projection's sub-projections at once: q/k/v and gate/up share their
  input), a 0/1 mask that keeps each row's own slot, one expand per sub-projection. That is
  punica's / vLLM's BGMV idea as dense products: at decode batch sizes the masked product reads
  each slot's weights once, which is what bounds it, and a gather of per-row weights would copy
  R x in floats per row instead. On CPU in float32 the products go through the AVX2 kernel
  (`cpu_kernels.linear`: the q/k/v shrink 94 us against MKL's 193 us with the weights out of
  cache, on the AMD EPYC), elsewhere through F.linear;
- prefill and speculative chunks (many rows, one adapter each): per run of rows on one slot,
  `y[rows] += (x[rows] A_slot^T) B_slot` (SGMV's segments), so long prompts pay for their own
  adapter only.

No loop runs over requests, and base-model rows cost nothing when no row of the step has an adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvharbor.engine.lora import SUB_PROJECTIONS, LoRAAdapter, SubShape, sub_shapes
from kvharbor.engine.model_arch import ModelArch

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight [n, k]) -> x @ weight^T
# Decode rows up to which the shrink and expand go through the CPU kernel (cpu_kernels.linear),
# as SkinnyLinear's rows do; more rows go to F.linear.
KERNEL_MAX_ROWS = 32

# Fused projection -> its PEFT sub-projections, in column order.
MODULES_OF = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}  # fmt: skip


class LoRASlots:
    """Per layer: `a[projection]` [subs, slots, R, in] (a sub-projection's rows over all slots are one
    contiguous [slots * R, in] weight, and so are a projection's over all its subs), and
    `bt[module]` [out, slots * R] (B transposed: one weight for the expand over all slots)."""

    def __init__(
        self,
        arch: ModelArch,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        linear: Linear | None = None,
    ) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.shapes: dict[str, SubShape] = sub_shapes(arch)
        self.dtype = dtype
        self.linear: Linear = linear or F.linear

        def a(projection: str) -> torch.Tensor:
            modules = MODULES_OF[projection]
            d_in = self.shapes[modules[0]].d_in
            return torch.zeros(len(modules), num_slots, max_rank, d_in, dtype=dtype, device=device)

        def bt(module: str) -> torch.Tensor:
            return torch.zeros(self.shapes[module].d_out, num_slots * max_rank, dtype=dtype, device=device)

        self.a = [{p: a(p) for p in MODULES_OF} for _ in range(arch.num_layers)]
        self.bt = [{m: bt(m) for m in self.shapes} for _ in range(arch.num_layers)]
        self.modules: list[frozenset[str]] = [frozenset()] * num_slots  # what each slot's adapter targets

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in (*self.a, *self.bt) for t in layer.values())

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` in `slot`, replacing what was there (ranks below max_rank are zero-padded)."""
        r, cols = adapter.rank, slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for layer in range(len(self.a)):
            for t in self.a[layer].values():
                t[:, slot].zero_()
            for t in self.bt[layer].values():
                t[:, cols].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            projection, index = SUB_PROJECTIONS[module]
            self.a[layer][projection][index, slot, :r].copy_(a)
            self.bt[layer][module][:, cols.start : cols.start + r].copy_(b)
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
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)  # the mask repeated per sub-projection

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
            cols = torch.arange(used, device=slots.a[0]["qkv"].device).repeat_interleave(r)
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
        modules = MODULES_OF[projection]
        if self.modules.isdisjoint(modules):
            return
        a, bt = self.slots.a[layer][projection], self.slots.bt[layer]
        if self.mask is not None:
            self._decode(a, bt, modules, x[: self.decode_rows], y[: self.decode_rows])
        for start, end, slot in self.segments:
            for j, module in enumerate(modules):
                if module in self.modules:
                    r = self.slots.max_rank
                    shrunk = F.linear(x[start:end], a[j, slot])
                    y[start:end, self._cols(module)] += F.linear(shrunk, bt[module][:, slot * r : (slot + 1) * r])

    def _decode(self, a: torch.Tensor, bt: dict, modules: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        subs, slots, r, d_in = a.shape
        linear = self.slots.linear if x.shape[0] <= KERNEL_MAX_ROWS else F.linear
        if self.used == slots:  # every slot: one shrink for all sub-projections, one expand each
            shrunk = linear(x, a.view(-1, d_in)).mul_(self._mask(subs))
            width = slots * r
            for j, module in enumerate(modules):
                if module in self.modules:
                    y[:, self._cols(module)] += linear(shrunk[:, j * width : (j + 1) * width], bt[module])
            return
        u = self.used  # slots [0, u) only: per sub-projection, the expand's weight is strided
        for j, module in enumerate(modules):
            if module in self.modules:
                shrunk = linear(x, a[j, :u].reshape(u * r, d_in)).mul_(self.mask)
                y[:, self._cols(module)] += F.linear(shrunk, bt[module][:, : u * r])

    def _mask(self, subs: int) -> torch.Tensor:
        if subs not in self._masks:
            self._masks[subs] = self.mask.repeat(1, subs)
        return self._masks[subs]

    def _cols(self, module: str) -> slice:
        shape = self.slots.shapes[module]
        return slice(shape.offset, shape.offset + shape.d_out)
