"""CPU fast paths for the model's linear layers, chosen once at load: `prepare_linears`.

- bfloat16 with oneDNN: weights prepacked for oneDNN (below).
- float32 on x86 with AVX2 + FMA: decode-sized inputs through kvharbor's kernel
  (engine/cpu_kernels.py), larger ones through F.linear on the same weight.
- anything else: F.linear.

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

import torch
import torch.nn.functional as F

log = logging.getLogger("kvharbor.engine.cpu_linear")


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


def prepare_linears(
    dtype: torch.dtype, device: torch.device, threads: int, weight_bytes: int
) -> tuple[str, Callable] | None:
    """(what it is, weight -> FastLinear) for this dtype and device, or None for plain F.linear.
    `weight_bytes`: the model's, to decide whether float32 prefill gets a packed copy."""
    if dtype == torch.bfloat16 and packing_available(dtype, device):
        return "weights prepacked for oneDNN", lambda w: functools.partial(_onednn, pack(w))
    if device.type == "cpu" and dtype == torch.float32:
        from kvharbor.engine.cpu_kernels import SkinnyLinear, load

        gemm = load(threads)
        prefill = packing_available(dtype, device) and weight_bytes <= PREFILL_PACK_MAX_BYTES
        if gemm is not None:
            what = f"AVX2 kernel for float32 decode rows ({gemm.threads} threads)"
            if prefill:
                what += f", prefill on a oneDNN-packed copy (+{weight_bytes / 2**20:.0f} MiB)"
            return what, lambda w: SkinnyLinear(gemm, w, pack(w, PREFILL_ROWS_HINT) if prefill else None)
    return None


PREFILL_ROWS_HINT = 128


def _onednn(packed: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(x, packed, bias)
