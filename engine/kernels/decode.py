"""Paged decode attention: one query token per sequence, K/V read through block tables.

One program per (sequence, KV head, split) holds that KV head's whole query group
(`heads / kv_heads` rows, padded to 16 for `tl.dot`), so each K/V block is loaded once per group,
not once per query head (GQA). It walks the sequence's blocks with an online softmax; positions
past the context length (the partial last block) are masked.

Split-KV (flash-decoding): with few sequences and long contexts, `batch x kv_heads` programs
leave most of a GPU idle, so the blocks are cut into `splits` ranges, each program writes a
partial output with its log-sum-exp, and a second kernel combines them. `choose_splits` decides.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvharbor.engine.kernels import interpreted, next_power_of_2
from kvharbor.engine.kernels.online_softmax import load_kv_block, softmax_step

MIN_BLOCKS_PER_SPLIT = 8  # below this a split's fixed cost outweighs its parallelism
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, out_ptr, lse_ptr, tables_ptr, lens_ptr, scale, blocks_per_split,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_tb,
    stride_c_kv, stride_c_h, stride_c_slot,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    head_base = kv_head.to(tl.int64) * stride_c_h  # 64-bit: (kv_heads - 1) x slots x dim can pass 2^31
    qmask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32) * scale
    if not DOT_FP32:
        q = q.to(cache_ptr.dtype.element_ty)  # tensor-core dots in the cache's dtype

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(tl.cdiv(ctx, BLOCK_SIZE), first + blocks_per_split)
    for blk in range(first, last):
        block_id = tl.load(tables_ptr + seq * stride_tb + blk).to(tl.int64)
        valid = blk * BLOCK_SIZE + offs < ctx
        k, v = load_kv_block(
            cache_ptr, head_base, block_id, offs, d, valid, stride_c_slot, stride_c_kv, HEAD_DIM, BLOCK_SIZE, DOT_FP32
        )
        m_i, l_i, acc = softmax_step(q, k, v, valid[None, :], m_i, l_i, acc)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    omask = qmask
    if SPLIT:
        dst = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(dst, out, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)
    else:
        dst = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _combine_kernel(
    parts_ptr, lse_ptr, out_ptr, splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s < splits, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # splits past the context have lse -inf: weight 0
    mask = (s < splits)[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(
        parts_ptr + seq * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :], mask=mask, other=0.0
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_splits(batch: int, kv_heads: int, max_ctx: int, block_size: int, num_sms: int | None) -> int:
    """How many KV splits per (sequence, KV head): 1 when the grid already fills the GPU (or
    there is no GPU to fill), else enough to give about two programs per SM, each with at least
    MIN_BLOCKS_PER_SPLIT blocks."""
    programs = batch * kv_heads
    if not num_sms or programs == 0 or programs >= num_sms:
        return 1
    blocks = math.ceil(max_ctx / block_size)
    by_length = blocks // MIN_BLOCKS_PER_SPLIT
    by_occupancy = math.ceil(2 * num_sms / programs)
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim]
    kv_cache: torch.Tensor,  # [2, kv_heads, slots, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int32
    context_lens: torch.Tensor,  # [batch] int32, >= 1
    block_size: int,
    scale: float,
    splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    kv_heads = kv_cache.shape[1]
    assert heads % kv_heads == 0, f"{heads} query heads do not group over {kv_heads} KV heads"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = heads // kv_heads
    blocks_per_split = math.ceil(block_tables.shape[1] / splits)
    common = dict(
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_SIZE=block_size, DOT_FP32=interpreted(),
    )  # fmt: skip
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2))
    if splits == 1:
        _decode_kernel[(batch, kv_heads, 1)](
            q, kv_cache, out, out, block_tables, context_lens, scale, blocks_per_split,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), 0, 0, 0, block_tables.stride(0),
            *cache_strides, SPLIT=False, **common,
        )  # fmt: skip
        return out
    parts = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        q, kv_cache, parts, lse, block_tables, context_lens, scale, blocks_per_split,
        q.stride(0), q.stride(1), parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1), block_tables.stride(0),
        *cache_strides, SPLIT=True, **common,
    )  # fmt: skip
    _combine_kernel[(batch, heads)](
        parts, lse, out, splits,
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)), SPLITS_PAD=next_power_of_2(splits),
    )  # fmt: skip
    return out
