"""A decoder layer's pointwise ops (residual add + RMS norm, RoPE, SiLU- or GELU-and-multiply), chosen once
at load: torch's (any dtype, any device), or the AVX2 kernels' (engine/cpu/cpu_kernels.py) for the few
rows of a decode step in float32 (every row in batch-invariant mode, whose activations are float32
in a bfloat16 model too).

Why the kernels: at batch 1 these ops are a few thousand floats each, and torch's dispatch is what
they cost. Measured on the AMD EPYC (float32, SmolLM2, one token of a decode step): F.rms_norm ran
as 9 ops and 72 us a call, and the pointwise ops together were about 9 ms of a 31 ms token under
--quantization gguf. Above CPU_MAX_ROWS rows (prefill chunks) torch's ops are the faster ones:
they are vectorized over both threads and their dispatch is amortized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_MAX_ROWS = 64


class TorchOps:
    """The reference: torch ops, any dtype and device."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual); a residual of None is taken as 0. A float32
        weight on narrower activations (Gemma's norms) is applied in float32, then rounded."""
        residual = x if residual is None else x + residual
        return _rms_norm(residual, weight, eps), residual

    def rope(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, dim] and k [T, kv_heads, dim] of the fused projection, rotated. RoPE on q and
        k together: they are adjacent in it."""
        t = qkv.shape[0]
        qk = rotate(qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim), cos, sin)
        return qk[:, :heads], qk[:, heads:]

    def head_norm(
        self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, q_weight: torch.Tensor,
        k_weight: torch.Tensor, eps: float,
    ) -> None:  # fmt: skip
        """Qwen3's and Gemma 3's q/k norm, in place on the fused projection: each query head
        RMS-normed with q_weight [dim], each key head with k_weight (float32 weights: in float32)."""
        t = qkv.shape[0]
        for start, count, weight in ((0, heads, q_weight), (heads * dim, kv_heads, k_weight)):
            part = qkv[:, start : start + count * dim].view(t, count, dim)
            part.copy_(_rms_norm(part, weight, eps))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's MLP: gelu (tanh approximation) of the gate, times up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last axis; a float32 weight on narrower x (Gemma's 1 + w) is applied in
    float32 and the result rounded to x's dtype, as HF's Gemma does."""
    if weight.dtype != x.dtype:
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's rotate_half convention: x * cos + [-x2, x1] * sin, with cos/sin duplicated per half.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CpuOps(TorchOps):
    """float32 activations on CPU: decode-sized inputs through the AVX2 kernels
    (cpu_kernels.CpuKernels), in place where the reference makes a new tensor (the residual, the
    fused q/k); larger ones through torch's ops. Norm weights of another dtype (a bfloat16 model
    run batch-invariant, on float32 activations) are widened once and kept."""

    def __init__(self, kernels, max_rows: int | None = CPU_MAX_ROWS) -> None:
        """`max_rows`: the most rows that go through the kernels; None: every row count (batch-
        invariant mode: torch's ops and the kernels round differently, and torch's vectorized
        loops take scalar tails at places that move with the tensor's size, so a token's norm
        would depend on the size of the batch it runs in)."""
        self.kernels = kernels
        self.max_rows = max_rows
        self._widened: dict[int, torch.Tensor] = {}

    def _float32(self, weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.float32:
            return weight
        if (kept := self._widened.get(weight.data_ptr())) is None:
            kept = self._widened[weight.data_ptr()] = weight.float()
        return kept

    def _torch(self, rows: int) -> bool:
        return self.max_rows is not None and rows > self.max_rows

    def add_rms_norm(self, x, residual, weight, eps):
        if self._torch(x.shape[0]):
            return super().add_rms_norm(x, residual, weight, eps)
        if residual is None:  # the first layer: x (the embedding's output, ours) becomes the residual
            residual, x = x.contiguous(), None
        return self.kernels.add_rms_norm(x, residual, self._float32(weight), eps), residual

    def rope(self, qkv, heads, kv_heads, dim, cos, sin):
        if self._torch(qkv.shape[0]):
            return super().rope(qkv, heads, kv_heads, dim, cos, sin)
        t = qkv.shape[0]
        self.kernels.rope(qkv, heads + kv_heads, dim, cos, sin)
        return qkv[:, : heads * dim].view(t, heads, dim), qkv[:, heads * dim : (heads + kv_heads) * dim].view(
            t, kv_heads, dim
        )

    def head_norm(self, qkv, heads, kv_heads, dim, q_weight, k_weight, eps):
        if self._torch(qkv.shape[0]):
            return super().head_norm(qkv, heads, kv_heads, dim, q_weight, k_weight, eps)
        t = qkv.shape[0]
        for start, count, weight in ((0, heads, q_weight), (heads * dim, kv_heads, k_weight)):
            part = qkv[:, start : start + count * dim]
            rows = part.reshape(t * count, dim).contiguous()  # one norm row per head
            part.copy_(self.kernels.add_rms_norm(None, rows, self._float32(weight), eps).view(t, count * dim))
        return None

    def silu_mul(self, gate_up):
        if self._torch(gate_up.shape[0]):
            return super().silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up)

    def gelu_tanh_mul(self, gate_up):
        if self._torch(gate_up.shape[0]):
            return super().gelu_tanh_mul(gate_up)
        return self.kernels.gelu_tanh_mul(gate_up)
