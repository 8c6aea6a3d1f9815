"""Weight-only quantization of the linear layers (`--quantization int8|int4|gguf`): the formats,
how float weights become them, and the linear that runs them.

Three formats, one kernel family (engine/cpu/csrc/packed_int.c with AVX512-VNNI, else cpu_kernels.c's
AVX2 tiles; which runs where, and how x is rounded for it, below):
- `int8`: symmetric, one scale per output channel, round-to-nearest of w / (max|w_row| / 127),
  so every weight is off by at most half a step. No zero points: one multiply per output.
- `q4`: 4 bits in groups of 32 along the input, a float scale and min per group,
  w = q * scale + min, q in 0..15. `--quantization int4` makes it from float weights (min/max
  of each group, as llama.cpp's Q4_1); `gguf` repacks the file's Q4_0 (min = -8 scale) and Q4_1
  blocks into it, bit for bit (engine/model/gguf_blocks.py).
- `q8`: int8 in groups of 32 with a float scale per group: GGUF's Q8_0, repacked.

The LM head: in `int8` and `int4` it is made q8 (int8 in groups of 32, GGUF's Q8_0; a tied
embedding reads its rows from that copy; a hidden size that is not a multiple of 32 keeps it
float), because it is the largest single weight a decode step reads (SmolLM2: 49,152 x 576,
113 MB in float32, a fifth of a batch-1 step); benchmarks/quality.py measured the difference
(gguf, whose file keeps it Q8_0, decoded at 1.84x float32 at batch 1 where int4 with a float head
made 1.22x). Groups, not one scale per row: with a per-row int8 head, int8's top-1 agreement fell
from 97.6% to 96.8% (mean KL 0.0033 -> 0.0052); with groups it is 97.2% (0.0036). It stays 8-bit under
int4: llama.cpp's 4-bit types keep the output matrix at 6-8 bits too, since every logit goes
through it. `gguf` keeps whatever the file has.

Why weight-only and these layouts: a float32 decode step here is memory-bound (benchmarks/README.md:
the layers' 425 MB stream at 11-15 GB/s), so the bytes a step reads are the lever. The nibbles
keep GGUF's in-group order (element j low, j + 16 high) so a repack is a byte copy; scales and
mins are float32 arrays beside them (6% of a q4 weight) so the kernel reads them without f16
conversions.

Which kernel runs. Where the CPU has AVX512-VNNI (Zen 4 and later, Intel Ice Lake and later) and
the linears run on 16 lanes (not KVHARBOR_KERNEL_LANES=8), every projection and the LM head whose
input width is a multiple of 32 (int8 weights may have others) are packed once at load into the
packed integer GEMM's layout (engine/cpu/csrc/packed_int.c; the row-major codes are released, a
tied embedding reads its rows from the packed head) and every row count runs there, with the mode
on or off: x is made 16-bit codes per group of 32 (within max|x_g| / 65,024 of x), held as a high
and a low byte, and each group is two exact integer dot products (vpdpbusd, 64 a instruction).
Measured on the 2-core family-26 EPYC (SmolLM2 q4, 30 layers): 35 ms at 128 rows against 63 for
dequantizing into the packed float GEMM and 115-148 for the integer tiles below; teacher-forced
logits within 0.004 of float32 on the same weights, so a gguf engine follows float32 on the file's
dequantized weights (benchmarks/README.md: 46 of 48 greedy tokens, llama.cpp 17.7).

Elsewhere (Zen 3, AVX2 only): decode-sized inputs (up to `max_rows`) go through the AVX2 kernel
straight from the quantized bytes, with x made int8 per group of 32 (INT_ROWS below, up to 32
rows) so each group is an integer dot product (maddubs, as llama.cpp's Q8 activations): the float
path was bound by widening 4-bit codes to floats, and this made SmolLM2's batch-1 linears 1.4x
faster (12.5-14.6 -> 9.0-9.8 ms a step, gguf) and 4-32-row ones 1.1-1.5x (cpu_kernels.c has the
figures); the cost is x's rounding, at most half of max|x_g| / 127 per element, which
benchmarks/quality.py's decode positions measure. Rows are quantized one by one, so a row's result
does not depend on the batch it runs in. Prefill-sized inputs are dequantized, a slice at a time,
straight into the packed GEMM's layout in one reused scratch buffer and multiplied there
(engine/cpu/csrc/packed_gemm.c: 1.4-1.6x MKL on the same dequantized slices, QuantLinear._product),
which blocks large products far better than a row-tiled kernel (the int8 kernel alone ran at 0.8x
MKL at 128 rows; llama.cpp dequantizes for BLAS in the same case). torch's own
`aten::_weight_int8pack_mm` was measured at 5.8 ms on an 8x576 by 576x1536 product on this
machine kind, 7x float32 MKL, so it is not used. Where the kernels do not run (CUDA, bfloat16,
`--no-cpu-kernels`, no AVX2), torch ops dequantize the same slices: the quantized memory without
the speed (no Triton kernel for it yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

Quantization = Literal["none", "int8", "int4", "gguf"]
QUANTIZATIONS: tuple[str, ...] = ("none", "int8", "int4", "gguf")
GROUP = 32  # elements per group in the q4 and q8 formats (GGUF's block size)
FORMATS = {"int8": 1, "q4": 2, "q8": 3}  # the kernel's format numbers (cpu_kernels.c)
# Scratch for the dequantized slice of a prefill product: bounded so the LM head (49,152 rows)
# goes in slices instead of a 113 MB float copy.
SCRATCH_FLOATS = 2 * 1024 * 1024
# Rows up to which a kernel call takes the integer path (cpu_kernels.c's INT_ROWS; the same number).
INT_ROWS = 32


@dataclass(frozen=True)
class QuantWeight:
    """One [n, k] weight in a kernel format: `data` int8 [n, k] (int8, q8) or uint8 [n, k/2] (q4);
    `scale` [n] (int8) or [n, k/32]; `mins` [n, k/32] for q4, else None."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor | None
    k: int

    def __post_init__(self) -> None:
        """Valid by construction, so the kernels need not check each call (120 a decode step)."""
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r} (known: {', '.join(FORMATS)})")
        if self.fmt != "int8" and self.k % GROUP:
            raise ValueError(f"a {self.fmt} weight needs rows a multiple of {GROUP} long, not {self.k}")
        want = torch.uint8 if self.fmt == "q4" else torch.int8
        tensors = [self.data, self.scale] + ([self.mins] if self.mins is not None else [])
        if self.data.dtype != want or any(not t.is_contiguous() for t in tensors) or self.scale.dtype != torch.float32:
            raise ValueError(f"a {self.fmt} weight needs contiguous {want} data and float32 scales")
        mins_ok = self.mins is None or self.mins.dtype == torch.float32
        if (self.fmt == "q4") != (self.mins is not None) or not mins_ok:
            raise ValueError("q4 weights, and only they, carry float32 mins")

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        extra = self.mins.numel() * 4 if self.mins is not None else 0
        return self.data.numel() + self.scale.numel() * 4 + extra

    def to(self, device: torch.device) -> QuantWeight:
        mins = self.mins.to(device) if self.mins is not None else None
        return QuantWeight(self.fmt, self.data.to(device), self.scale.to(device), mins, self.k)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight's rows in `index` order (row permutations, fused-projection slices)."""
        mins = self.mins[index] if self.mins is not None else None
        return QuantWeight(self.fmt, self.data[index].contiguous(), self.scale[index].contiguous(), mins, self.k)

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """float32 [n, k] (or the selected rows, an index tensor or a slice): the reference formula
        the kernels must match, and the torch path where they do not run."""
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        data, scale = pick(self.data), pick(self.scale)
        if self.fmt == "int8":
            return data.to(torch.float32) * scale[..., None]
        if self.fmt == "q8":
            return (data.to(torch.float32).unflatten(-1, (-1, GROUP)) * scale[..., None]).flatten(-2)
        nibbles = data.unflatten(-1, (-1, GROUP // 2))  # [..., groups, 16]
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).to(torch.float32)  # elements j, then j + 16
        return torch.addcmul(pick(self.mins)[..., None], q, scale[..., None]).flatten(-2)


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """Row-wise concatenation (fused q/k/v, gate/up) of parts of one width. Parts in different
    formats (a GGUF file's q and k in Q4_K, its v in Q6_K, as llama.cpp's _M mixes write them)
    are all made q8, the finest format: one kernel call needs one format."""
    first = parts[0]
    if any(p.k != first.k for p in parts):
        kinds = ", ".join(f"{p.fmt}[{p.n}x{p.k}]" for p in parts)
        raise ValueError(f"a fused projection needs one width for its parts, got {kinds}")
    if any(p.fmt != first.fmt for p in parts):
        parts = [p if p.fmt == "q8" else quantize_q8(p.dequantize()) for p in parts]
        first = parts[0]
    mins = torch.cat([p.mins for p in parts]) if first.mins is not None else None
    return QuantWeight(
        first.fmt, torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), mins, first.k
    )


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scale float32 [n]) with weight ~= q * scale[:, None]; a row of zeros gets
    scale 1 (its q is all zeros)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4(weight: torch.Tensor) -> QuantWeight:
    """q4 with each group's min and max as the ends of its 16 levels (a group of equal values
    gets scale 1 and is exact). Every weight is off by at most half a step of its group."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int4 quantizes rows in groups of {GROUP}; this weight's rows are {k} long")
    w = weight.detach().to(torch.float32).reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)  # element j low, j + 16 high
    return QuantWeight("q4", packed.reshape(n, k // 2).contiguous(), scale.contiguous(), lo.contiguous(), k)


def quantize_q8(weight: torch.Tensor) -> QuantWeight:
    """q8: int8 in groups of 32 with a float scale each (GGUF's Q8_0 rule, max|w_g| / 127):
    finer than one scale per row, for the LM head, whose every logit a top-1 choice compares."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"q8 quantizes rows in groups of {GROUP}; this weight's rows are {k} long")
    w = weight.detach().to(torch.float32).reshape(n, k // GROUP, GROUP)
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight("q8", q.reshape(n, k).contiguous(), scale.contiguous(), None, k)


def quantize(weight: torch.Tensor, mode: str) -> QuantWeight:
    """A float weight in the format `--quantization mode` gives it (int8 or int4)."""
    if mode == "int8":
        q, scale = quantize_int8(weight)
        return QuantWeight("int8", q, scale, None, weight.shape[1])
    if mode == "int4":
        return quantize_int4(weight)
    raise ValueError(f"cannot quantize float weights to {mode!r} (choose int8 or int4)")


def packs(gemm, k: int) -> bool:
    """Whether a weight of k inputs runs on the packed integer GEMM (csrc/packed_int.c) through
    `gemm`: its kernels have AVX512-VNNI with the linears on 16 lanes, and k is whole groups."""
    return gemm is not None and gemm.int_packs() and k % GROUP == 0


class QuantLinear:
    """One projection's quantized weight. With the CPU kernels (`gemm`): where the weight packs
    (`packs`), every input through the packed integer GEMM; else decode-sized inputs through the
    integer tiles on the quantized bytes, larger ones through the packed GEMM on dequantized
    slices (the module docstring says why); bfloat16 rows are widened to float32 for them and the
    result rounded back once. Without them (CUDA, no AVX2): every input through slices dequantized
    by torch ops into x's dtype: the memory of the quantized weights at the cost of a
    dequantization per step (no fused kernel for that path yet)."""

    def __init__(self, gemm, weight: QuantWeight, max_rows: int, invariant: bool = False) -> None:
        """Where the CPU has AVX512-VNNI (`gemm.int_packs()`), every input runs through the packed
        integer GEMM (csrc/packed_int.c: x as 16-bit codes, near float32's products, each row on
        its own), and only its packed copy is kept, whatever `invariant` says. Elsewhere
        `invariant` (batch-invariant mode, needs `gemm`) keeps every input on the integer tiles,
        INT_ROWS rows a call, so a row's result never depends on the others."""
        if invariant and gemm is None:
            raise ValueError("batch-invariant quantized linears need kvharbor's CPU kernels (AVX2)")
        self.gemm = gemm
        self.max_rows = max_rows if gemm is not None else -1
        self.invariant = invariant
        self.int_packed = None
        if packs(gemm, weight.k):
            self.int_packed = gemm.pack_quant(weight)
        self.weight: QuantWeight | None = None if self.int_packed is not None else weight

    @property
    def nbytes(self) -> int:
        return self.int_packed.nbytes if self.int_packed is not None else self.weight.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gemm is not None and x.dtype != torch.float32:  # the kernels take float32 rows
            # NOTE: measured on the AMD EPYC Zen 4 (benchmarks/README.md, the bfloat16 ledger):
            # bfloat16 through torch's dequantize-and-matmul ran gguf at 0.10x bfloat16's speed.
            return self(x.float(), None if bias is None else bias.float()).to(x.dtype)
        if self.int_packed is not None:
            return self.gemm.linear_qpacked(x, self.int_packed, bias)
        if self.invariant and x.shape[0] > INT_ROWS:
            return torch.cat([self.gemm.linear_quant(x[r : r + INT_ROWS], self.weight, bias)
                              for r in range(0, x.shape[0], INT_ROWS)])  # fmt: skip
        if x.shape[0] <= self.max_rows:
            return self.gemm.linear_quant(x, self.weight, bias)
        w = self.weight
        step = max(1, SCRATCH_FLOATS // w.k)
        if step >= w.n:
            return self._product(x, 0, w.n, bias)
        y = torch.empty(x.shape[0], w.n, dtype=x.dtype, device=x.device)
        for a in range(0, w.n, step):
            b = min(w.n, a + step)
            y[:, a:b] = self._product(x, a, b, None if bias is None else bias[a:b])
        return y

    def _product(self, x: torch.Tensor, first: int, last: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ rows [first, last) of the weight^T: with the kernels, dequantized straight into the
        packed GEMM's layout and multiplied there.
        NOTE: measured on the 2-core family-26 EPYC (2026-12-07, 128 rows, int4 weights): dequantize
        + pack + packed GEMM against dequantize + MKL, 1.71 / 2.67 ms on SmolLM2's gate/up, 0.83 /
        1.18 on down, 0.32 / 0.50 on q/o; dequantizing into the packed layout then saves the
        packing's 0.06-0.27 ms."""
        if self.gemm is None or x.dtype != torch.float32:
            return F.linear(x, self.weight.dequantize(slice(first, last)).to(x.dtype), bias)
        return self.gemm.linear_packed(x, self.gemm.dequantize_packed(self.weight, first, last), bias)
