"""CPU fast paths for the model's linear layers, chosen once at load: `prepare_linears`.

- bfloat16 with oneDNN: weights prepacked for oneDNN (below).
- float32 on x86 with AVX2 + FMA: kvharbor's packed GEMM for every row count where the start-up
  probe measured it faster than oneDNN (engine/cpu/kernel_probe.py); else decode-sized inputs
  through kvharbor's kernel (engine/cpu/cpu_kernels.py), larger ones through oneDNN's packed copy
  or F.linear.
- anything else: F.linear.
- batch-invariant mode (`invariant=True`): every row count through kvharbor's packed GEMM
  (engine/cpu/csrc/packed_gemm.c: float32 weights, or bfloat16 weights widened exactly, products
  summed in float32), whose order of summation does not depend on how many rows a call has;
  oneDNN and MKL choose their blocking by the row count, so a token's projection would change with
  the batch it runs in. The projections and the LM head are packed once at load and their
  unpacked copies released; a tied embedding's lookups read the LM head's packed copy.
  bfloat16 projections on a CPU with AVX512-BF16 take their input rows rounded to bfloat16 and
  multiply in k-pairs (vdpbf16ps: 855-970 GFLOP/s against 520-535 widened, 2 cores of a family-26
  EPYC), as oneDNN's bfloat16 does; their sums and outputs stay float32. The LM head keeps float32
  inputs (below): it runs on a few rows, where it is bound by reading its weight, not by products.

The LM head has its own choice, `float32_head`: logits are always float32 sums of float32 (or
exactly widened) products, never rounded to the model dtype: bfloat16 logits of ~25 are 0.125
apart, and two candidate tokens' logits were seen rounded onto one value (issue 21).

torch's F.linear in bfloat16 re-lays the weight out for oneDNN on every call; a decode step reads
each weight once, so that work is never amortized. Prepacking once at load made a SmolLM2 decode
step 10-20% faster on 2 cores (batch 1-32). The packed path uses private torch ops
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`), so it is probed against
F.linear at load and falls back to F.linear wherever it is missing or disagrees.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("kvharbor.engine.cpu.cpu_linear")


# Float32 weights are kept twice when prefill gets a oneDNN-packed copy: only for models up to this
# size (SmolLM2 is 538 MB), where the copy costs less than the prefill time it saves.
PREFILL_PACK_MAX_BYTES = 2 * 1024**3


@functools.cache
def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether prepacked oneDNN linears exist here for this dtype (bfloat16 or float32) and agree
    with F.linear on a probe."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(96, 64, generator=gen).to(dtype)
        x = torch.randn(40, 64, generator=gen).to(dtype)
        got = packed_linear(x, pack(w), None)
        want = F.linear(x.double(), w.double())
    except (RuntimeError, AttributeError) as exc:
        log.info("prepacked linears unavailable, using F.linear", extra={"dtype": str(dtype), "error": repr(exc)})
        return False
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    return bool(torch.allclose(got.double(), want, rtol=tol, atol=tol))


def pack(weight: torch.Tensor, rows_hint: int = 16) -> torch.Tensor:
    """The oneDNN layout of a [out, in] weight (the rows hint only tunes the blocking)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


FastLinear = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]  # (x, bias) -> y


@dataclass(frozen=True)
class LinearPlan:
    """What prepare_linears chose: its description, and weight -> FastLinear for the projections
    and for a float32 LM head."""

    what: str
    make: Callable[[torch.Tensor], FastLinear]
    make_head: Callable[[torch.Tensor], FastLinear]


def prepare_linears(
    dtype: torch.dtype, device: torch.device, threads: int, weight_bytes: int, invariant: bool = False
) -> LinearPlan | None:
    """The fast linears for this dtype and device, or None for plain F.linear. `weight_bytes`: the
    model's, to decide whether float32 prefill gets a packed copy. `invariant`: the batch-invariant
    kernels for every row count (ValueError where they cannot run)."""
    if invariant:
        return _invariant_linears(dtype, device, threads)
    if dtype == torch.bfloat16 and packing_available(dtype, device):
        onednn = lambda w: functools.partial(_onednn, pack(w))  # noqa: E731
        return LinearPlan("weights prepacked for oneDNN", onednn, onednn)
    if device.type == "cpu" and dtype == torch.float32:
        from kvharbor.engine.cpu.cpu_kernels import SkinnyLinear, load
        from kvharbor.engine.cpu.kernel_probe import probed

        gemm = load(threads)
        choice = probed(threads, False) if gemm is not None else None
        if choice is not None and choice.prefill == "kvharbor":  # measured faster here
            what = f"kvharbor's packed GEMM for every row count, measured faster than oneDNN ({gemm.threads} threads)"
            packed = functools.partial(PackedLinear, gemm)
            return LinearPlan(what, packed, packed)
        prefill = packing_available(dtype, device) and weight_bytes <= PREFILL_PACK_MAX_BYTES
        if gemm is not None:
            what = f"AVX2 kernel for float32 decode rows ({gemm.threads} threads)"
            if prefill:
                what += f", prefill on a oneDNN-packed copy (+{weight_bytes / 2**20:.0f} MiB)"
            skinny = lambda w: SkinnyLinear(gemm, w, pack(w, PREFILL_ROWS_HINT) if prefill else None)  # noqa: E731
            return LinearPlan(what, skinny, skinny)
    return None


PREFILL_ROWS_HINT = 128


def _invariant_linears(dtype: torch.dtype, device: torch.device, threads: int) -> LinearPlan:
    from kvharbor.engine.cpu.cpu_kernels import load

    gemm = load(threads) if device.type == "cpu" else None
    if gemm is None or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"batch-invariant linears need kvharbor's CPU kernels (x86-64 with AVX2 + FMA, a C compiler) and "
            f"float32 or bfloat16, here {str(dtype).removeprefix('torch.')} on {device.type}: "
            "run with --batch-invariant off"
        )
    what = (f"batch-invariant: every row count through kvharbor's packed GEMM ({gemm.threads} threads, "
            f"{gemm.lanes()} lanes, panels {gemm.packed_width()} wide)")  # fmt: skip
    dot = dtype == torch.bfloat16 and gemm.bf16_dot()
    if dot:
        what += ", projections' inputs rounded to bfloat16 (AVX512-BF16), float32 sums"
    elif dtype == torch.bfloat16:
        what += ", float32 activations"
    head = functools.partial(PackedLinear, gemm)
    return LinearPlan(what, functools.partial(PackedLinear, gemm, dot=dot), head)


class PackedLinear:
    """A float32 or bfloat16 weight packed once for the batch-invariant GEMM
    (cpu_kernels.CpuKernels.pack / linear_packed): float32 rows in, float32 rows out; with `dot`
    (bfloat16, AVX512-BF16) the rows are rounded to bfloat16 first. It holds the only copy the
    projection needs (`owns_weight`: its owner may release the unpacked one)."""

    owns_weight = True

    def __init__(self, gemm, weight: torch.Tensor, dot: bool = False) -> None:
        self.gemm = gemm
        self.weight = gemm.pack(weight.contiguous(), dot=dot and weight.dtype == torch.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemm.linear_packed(x.float(), self.weight, bias)


class Bf16Linear:
    """A bfloat16 weight through the kernel (cpu_kernels.CpuKernels.linear_bf16): x widened to
    float32, float32 sums in one fixed order, the result returned as `out_dtype`."""

    def __init__(self, gemm, weight: torch.Tensor, out_dtype: torch.dtype) -> None:
        self.gemm = gemm
        self.weight = weight.contiguous()
        self.out_dtype = out_dtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.gemm.linear_bf16(x.float(), self.weight, bias)
        return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)


# Weight elements widened to float32 at a time by WidenedLinear (16 MB of scratch).
WIDEN_ELEMENTS = 4 * 1024 * 1024


class WidenedLinear:
    """float32 products of a low-precision weight where no kernel runs (CUDA, no AVX2): a slice of
    rows widened at a time, so the float32 copy is never whole."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w, x = self.weight, x.float()
        n, step = w.shape[0], max(1, WIDEN_ELEMENTS // max(1, w.shape[1]))
        y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
        for a in range(0, n, step):
            b = min(n, a + step)
            y[:, a:b] = F.linear(x, w[a:b].float(), None if bias is None else bias[a:b].float())
        return y


@functools.cache
def mm_float32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm takes `dtype` inputs and writes float32 here (out_dtype: CUDA; not CPU)."""
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def float32_head(weight: torch.Tensor, fast: FastLinear | None, gemm) -> FastLinear:
    """The LM head as float32 logits from float32 rows: a quantized head's own kernel (`fast`,
    already float32), a float32 weight's fast path or F.linear, a bfloat16 weight through the
    kernel (`gemm`, None where it does not run), a low-precision GEMM with float32 output where
    torch has one (CUDA: the rows rounded to the weight's dtype, the sums float32), else widened
    slices (re-widening the head every step: CPUs without the kernels)."""
    if fast is not None:
        return fast
    if weight.dtype == torch.float32:
        return lambda x, bias: F.linear(x, weight, bias)
    if gemm is not None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
        return Bf16Linear(gemm, weight, torch.float32)
    if weight.device.type != "cpu" and mm_float32_out(weight.device, weight.dtype):
        return lambda x, bias: _mm_float32(x, weight, bias)
    return WidenedLinear(weight)


def _mm_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.mm(x.to(weight.dtype), weight.t(), out_dtype=torch.float32)
    return y if bias is None else y + bias.float()


def _onednn(packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(x, packed, bias)
