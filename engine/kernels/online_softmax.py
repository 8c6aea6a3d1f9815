"""The inner loop both attention kernels share: load one K/V block of the paged cache, and fold
it into a running (max, sum, weighted values) softmax, so a query never needs its whole row of
scores at once. Triton inlines these into each kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_block(
    cache_ptr, head_base, block_id, offs, d, valid, stride_c_slot, stride_c_kv,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """K and V [BLOCK_SIZE, BLOCK_D] of one cache block; rows where `valid` is false read as 0."""
    rows = cache_ptr + head_base + (block_id * BLOCK_SIZE + offs)[:, None] * stride_c_slot + d[None, :]
    mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(rows, mask=mask, other=0.0)
    v = tl.load(rows + stride_c_kv, mask=mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def softmax_step(q, k, v, visible, m_i, l_i, acc):
    """Scores of q against this block's keys (where `visible`), folded into the running state."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc
