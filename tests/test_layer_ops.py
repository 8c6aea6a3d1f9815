"""The layers' pointwise ops (engine/cpu/layer_ops.py): the AVX2 kernels' (CpuOps) give what torch's
(TorchOps) give, for decode-sized batches (the kernels) and larger ones (torch again)."""

from __future__ import annotations

import pytest
import torch

from kvharbor.engine.cpu import cpu_kernels
from kvharbor.engine.cpu.layer_ops import CPU_MAX_ROWS, CpuOps, TorchOps

KERNELS = cpu_kernels.load(2)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the AVX2 kernels cannot run or build here")
TOL = 1e-5  # float32 in another order (tests/test_cpu_kernels.py's POINTWISE_TOL)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= TOL * max(1.0, b.abs().max().item()))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, CPU_MAX_ROWS, CPU_MAX_ROWS + 1])
def test_cpu_ops_give_what_torch_ops_give(rows):
    gen = torch.Generator().manual_seed(rows)
    heads, kv_heads, dim, hidden = 9, 3, 64, 576
    cpu, ref = CpuOps(KERNELS), TorchOps()
    x, w = torch.randn(rows, hidden, generator=gen), torch.randn(hidden, generator=gen)
    h_ref, res_ref = ref.add_rms_norm(x, None, w, 1e-5)
    h, res = cpu.add_rms_norm(x.clone(), None, w, 1e-5)
    assert close(h, h_ref) and close(res, res_ref)
    o = torch.randn(rows, hidden, generator=gen)
    h_ref, res_ref = ref.add_rms_norm(o, res_ref, w, 1e-5)
    h, res = cpu.add_rms_norm(o, res, w, 1e-5)
    assert close(h, h_ref) and close(res, res_ref)

    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.randn(rows, 1, dim // 2, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    q_ref, k_ref = ref.rope(qkv, heads, kv_heads, dim, cos, sin)
    q, k = cpu.rope(qkv.clone(), heads, kv_heads, dim, cos, sin)
    assert close(q, q_ref) and close(k, k_ref)

    gate_up = torch.randn(rows, 2 * 1536, generator=gen)
    assert close(cpu.silu_mul(gate_up), ref.silu_mul(gate_up))
