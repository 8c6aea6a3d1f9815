"""KV-cache write: scatter the new K and V of a flat token batch into the paged cache.

One program per (token, KV head) copies a `head_dim` row of K and one of V to
`cache[0 | 1, head, slot]`. A negative slot means padding and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvharbor.engine.kernels import next_power_of_2


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_h, stride_c_slot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (d < HEAD_DIM) & (d * 0 + slot >= 0)  # the slot test broadcast to a row
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    dst = cache_ptr + head.to(tl.int64) * stride_c_h + slot * stride_c_slot + d
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [tokens, kv_heads, head_dim]; kv_cache: [2, kv_heads, slots, head_dim]; slot_mapping: [tokens]."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1, "rows must be contiguous"
    assert kv_cache.dtype == k.dtype == v.dtype, f"K/V {k.dtype} must match the cache's {kv_cache.dtype}"
    _kv_write_kernel[(tokens, kv_heads)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
    )  # fmt: skip
