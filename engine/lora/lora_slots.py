"""Adapter slots and one step's LoRA deltas, applied to a flat batch in a few calls per projection.

`LoRASlots` holds --max-loras slots of --max-lora-rank, per layer (engine/lora/adapter.py), in the model's
dtype: A as `[sub-projections, slots, R, in]` per fused projection and B transposed as
`[out, slots * R]` per sub-projection, zero where an adapter's rank or modules stop, so any mix of
ranks and targets runs through the same shapes. `LoRAStep` is one step's map from rows to slots,
and adds each row's delta to a projection's output:

- decode rows (the runner puts them first), on CPU with the AVX2 kernels: one call per projection
  (`cpu_kernels.lora_decode`, punica's / vLLM's BGMV): each row's shrink by its own slot's A for
  all sub-projections, then each row's expand by its slot's B added into the output in place,
  float32 sums over float32 or bfloat16 weights. With 8 rows on 8 adapters in bfloat16 on a
  2-core Xeon this took SmolLM2's LoRA step cost from +22 to +17 ms (base step 48 ms): the torch
  version below, with the kernel's plain linear for its products, spent more in the mask
  multiply, casts, slices and adds around its 11 products a layer than in the products;
- decode rows elsewhere (or more than KERNEL_MAX_ROWS): one shrink over every used slot (over all
  of a projection's sub-projections at once when at least half the slots are used: q/k/v and
  gate/up share their input), a 0/1 mask that keeps each row's own slot, one expand per
  sub-projection: BGMV as dense products, which read each used slot's weights once;
- prefill and speculative chunks (many rows, one adapter each): each run of rows on one slot
  (SGMV's segment) is cut into pieces of at most PIECE_ROWS rows, and all pieces go through one
  batched shrink per projection and one batched expand per sub-projection (torch.bmm on the
  pieces' rows and on each piece's slot weights; the deltas are laid back out as batch rows and
  added densely), so long prompts pay for their own adapter only. A loop of two products per
  segment and sub-projection cost 2.8x as much in bfloat16 on a 2-core Xeon (8 segments of 128
  rows, rank 16: 19.5 ms a layer against 6.9 ms): each small oneDNN call costs about 40 us
  however small it is.

No loop runs over requests, and base-model rows cost nothing when no row of the step has an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvharbor.engine.cpu.cpu_kernels import CpuKernels
from kvharbor.engine.lora.adapter import SUB_PROJECTIONS, LoRAAdapter, SubShape, sub_shapes
from kvharbor.engine.model.arch import ModelArch

# Decode rows up to which the deltas go through the CPU kernel (cpu_kernels.lora_decode), as
# SkinnyLinear's rows do; more rows go through torch's masked products.
KERNEL_MAX_ROWS = 32
# Rows per piece of a prefill segment in the batched products: padding wastes less than a piece a
# segment, and fewer, longer pieces waste less of each product's fixed cost.
PIECE_ROWS = 64

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
        kernels: CpuKernels | None = None,
    ) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.shapes: dict[str, SubShape] = sub_shapes(arch)
        self.dtype = dtype
        self.kernels = kernels  # decode rows' deltas on CPU (cpu_kernels.lora_decode); None: torch's products

        def a(projection: str) -> torch.Tensor:
            modules = MODULES_OF[projection]
            d_in = self.shapes[modules[0]].d_in
            return torch.zeros(len(modules), num_slots, max_rank, d_in, dtype=dtype, device=device)

        def bt(module: str) -> torch.Tensor:
            return torch.zeros(self.shapes[module].d_out, num_slots * max_rank, dtype=dtype, device=device)

        self.a = [{p: a(p) for p in MODULES_OF} for _ in range(arch.num_layers)]
        self.bt = [{m: bt(m) for m in self.shapes} for _ in range(arch.num_layers)]
        self.modules: list[frozenset[str]] = [frozenset()] * num_slots  # what each slot's adapter targets
        self.plans = None
        if kernels is not None:
            def plan(layer: int, projection: str):
                modules = MODULES_OF[projection]
                bts = [self.bt[layer][m] for m in modules]
                return kernels.lora_plan(self.a[layer][projection], bts, [self.shapes[m].offset for m in modules])

            self.plans = [{p: plan(layer, p) for p in MODULES_OF} for layer in range(arch.num_layers)]

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
    mask: torch.Tensor | None  # [decode_rows, slots * R]; None: no decode row has an adapter
    row_slot: torch.Tensor | None  # [decode_rows] int32, -1 for the base model (the CPU kernel's map)
    pieces: Pieces | None  # the other rows with an adapter, for the batched products; None: none
    modules: frozenset[str]  # sub-projections some row of the step adapts
    enabled: dict[str, int]  # projection -> bit j set where its sub-projection j is adapted (the kernel's)
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)  # the mask repeated per sub-projection

    @classmethod
    def build(cls, slots: LoRASlots, row_slots: list[tuple[int, int]], decode_rows: int) -> LoRAStep | None:
        """`row_slots`: (tokens, slot or -1 for the base model) per chunk, in batch order, the
        first `decode_rows` chunks one token each. None when no chunk has an adapter."""
        if all(slot < 0 for _, slot in row_slots):
            return None
        decode = [slot for _, slot in row_slots[:decode_rows]]
        used = max(decode, default=-1) + 1
        mask = row_slot = None
        device = slots.a[0]["qkv"].device
        if used and slots.kernels is not None and decode_rows <= KERNEL_MAX_ROWS:
            row_slot = torch.tensor(decode, dtype=torch.int32)
        elif used:  # over every slot: the shrink may run over all of them (_decode)
            cols = torch.arange(slots.num_slots, device=device).repeat_interleave(slots.max_rank)
            mask = (torch.tensor(decode, device=device)[:, None] == cols[None, :]).to(slots.dtype)
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
        pieces = Pieces.cut(segments, device) if segments else None
        enabled = {p: sum(1 << j for j, m in enumerate(subs) if m in modules) for p, subs in MODULES_OF.items()}
        return cls(slots, decode_rows, used, mask, row_slot, pieces, modules, enabled)

    def apply(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each row's LoRA delta for `projection` (a fused output) of `layer`, x its input."""
        modules = MODULES_OF[projection]
        if self.modules.isdisjoint(modules):
            return
        a, bt = self.slots.a[layer][projection], self.slots.bt[layer]
        if self.row_slot is not None:
            plan, rows = self.slots.plans[layer][projection], self.decode_rows
            self.slots.kernels.lora_decode(plan, x[:rows], self.row_slot, self.enabled[projection], y[:rows])
        elif self.mask is not None:
            self._decode(a, bt, modules, x[: self.decode_rows], y[: self.decode_rows])
        if self.pieces is not None:
            self._segments(a, bt, modules, x, y)

    def _segments(self, a: torch.Tensor, bt: dict, modules: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        p = self.pieces
        subs, slots, r, d_in = a.shape
        xg = x[p.start : p.end] if p.inverse is None else x.index_select(0, p.rows)
        weights = a.transpose(0, 1).index_select(0, p.slots).view(p.count, subs * r, d_in)
        shrunk = torch.bmm(xg.view(p.count, p.length, d_in), weights.transpose(1, 2))
        for j, module in enumerate(modules):
            if module in self.modules:
                b = bt[module].view(-1, slots, r).transpose(0, 1).index_select(0, p.slots)  # [pieces, out, R]
                delta = torch.bmm(shrunk[:, :, j * r : (j + 1) * r], b.transpose(1, 2))
                y[p.start : p.end, self._cols(module)] += p.place(delta.view(p.count * p.length, -1))

    def _decode(self, a: torch.Tensor, bt: dict, modules: tuple[str, ...], x: torch.Tensor, y: torch.Tensor) -> None:
        subs, slots, r, d_in = a.shape
        if 2 * self.used >= slots:  # one shrink for all sub-projections and slots, one expand each
            shrunk = F.linear(x, a.view(-1, d_in)).mul_(self._mask(subs))
            width = slots * r
            for j, module in enumerate(modules):
                if module in self.modules:
                    y[:, self._cols(module)] += F.linear(shrunk[:, j * width : (j + 1) * width], bt[module])
            return
        u = self.used  # slots [0, u) only: per sub-projection, the expand's weight is strided
        for j, module in enumerate(modules):
            if module in self.modules:
                shrunk = F.linear(x, a[j, :u].reshape(u * r, d_in)).mul_(self.mask[:, : u * r])
                y[:, self._cols(module)] += F.linear(shrunk, bt[module][:, : u * r])

    def _mask(self, subs: int) -> torch.Tensor:
        if subs not in self._masks:
            self._masks[subs] = self.mask.repeat(1, subs)
        return self._masks[subs]

    def _cols(self, module: str) -> slice:
        shape = self.slots.shapes[module]
        return slice(shape.offset, shape.offset + shape.d_out)


@dataclass
class Pieces:
    """A step's prefill segments cut into `count` pieces of `length` rows for batched products:
    `rows` [count * length] the batch row of each piece row (a padding row repeats its piece's
    last row; its product is computed and never read), `slots` [count]. `inverse` [end - start]
    maps each batch row of [start, end) to the piece row holding its delta, or to one zero row
    after the pieces' rows for a base-model row; None when that map is the identity."""

    rows: torch.Tensor
    slots: torch.Tensor
    count: int
    length: int
    start: int
    end: int
    inverse: torch.Tensor | None
    zero_row: bool  # some row of [start, end) is the base model's

    @classmethod
    def cut(cls, segments: list[tuple[int, int, int]], device: torch.device) -> Pieces:
        length = min(PIECE_ROWS, max(end - start for start, end, _ in segments))
        start, end = segments[0][0], segments[-1][1]
        rows, slots = [], []
        inverse = [-1] * (end - start)
        for first, stop, slot in segments:
            for piece_first in range(first, stop, length):
                last = min(piece_first + length, stop)
                for row in range(piece_first, last):
                    inverse[row - start] = len(rows) + row - piece_first
                rows += [*range(piece_first, last), *[last - 1] * (piece_first + length - last)]
                slots.append(slot)
        zero_row = -1 in inverse
        inverse = [len(rows) if i < 0 else i for i in inverse]
        identity = inverse == list(range(len(rows)))
        return cls(
            torch.tensor(rows, device=device), torch.tensor(slots, device=device), len(slots), length, start, end,
            None if identity else torch.tensor(inverse, device=device), zero_row,
        )  # fmt: skip

    def place(self, delta: torch.Tensor) -> torch.Tensor:
        """The piece rows' `delta` [count * length, out] laid out as batch rows [start, end): a
        gather and a dense add cost a third of an index_add_ into the fused output's columns
        (1,024 rows x 1,536 columns: 0.58 ms against 1.71 ms, bfloat16, 2-core Xeon)."""
        if self.inverse is None:
            return delta
        if self.zero_row:
            delta = F.pad(delta, (0, 0, 0, 1))
        return delta.index_select(0, self.inverse)
