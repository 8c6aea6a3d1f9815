"""Weight-only int8 for the linear layers (`--quantization int8`): symmetric, one scale per output
channel, float32 activations and accumulation.

Why this shape: a float32 decode step here is memory-bound (benchmarks/README.md: the layers'
425 MB of weights stream at 11-15 GB/s), so a quarter of the bytes is the lever. Per-channel
symmetric scales need no zero points and one multiply per output, after the sum; the values are
the round-to-nearest of w / (max|w_row| / 127), so every weight is off by at most half a step.

Kernel: engine/csrc/cpu_kernels.c's int8 linear (AVX2: 8 int8 weights widened to floats per
FMA), for every row count. torch's own `aten::_weight_int8pack_mm` was measured at 5.8 ms on an
8x576 by 576x1536 product on this machine kind, 7x float32 MKL, so it is not used. Embeddings,
norms and the LM head stay float (the LM head shares its weight with the embeddings, and its
rows are a minority of a step's bytes). CUDA has no int8 path yet: the engine refuses it there.
"""

from __future__ import annotations

from typing import Literal

import torch

Quantization = Literal["none", "int8"]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k], scale float32 [n]) with weight ~= q * scale[:, None]; a row of zeros gets
    scale 1 (its q is all zeros)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale[:, None]


class Int8Linear:
    """One projection's int8 weight; every input goes through the kernel (engine/cpu_kernels.py)."""

    def __init__(self, gemm, weight: torch.Tensor) -> None:
        self.gemm = gemm
        self.q, self.scale = quantize_int8(weight)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.gemm.linear_q8(x, self.q, self.scale, bias)
