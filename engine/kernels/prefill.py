"""Paged prefill / chunked-prefill attention: variable-length query chunks, each attending
causally to its sequence's cached K/V plus its own new tokens (already written to the cache by
`write_kv`), aligned bottom-right: a chunk of `q_len` tokens in a context of `ctx_len` sits at
positions `ctx_len - q_len ... ctx_len - 1`.

One program per (query tile of BLOCK_M rows, sequence, query head) walks the sequence's blocks
up to the last key its rows may see, with an online softmax; one K/V block per iteration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvharbor.engine.kernels import interpreted, next_power_of_2
from kvharbor.engine.kernels.online_softmax import load_kv_block, softmax_step


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, out_ptr, tables_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, stride_c_kv, stride_c_h, stride_c_slot,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + seq)
    if tile * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    ctx = tl.load(ctx_lens_ptr + seq)
    kv_head = head // GROUP
    head_base = kv_head.to(tl.int64) * stride_c_h  # 64-bit: (kv_heads - 1) x slots x dim can pass 2^31
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qmask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32) * scale
    if not DOT_FP32:
        q = q.to(cache_ptr.dtype.element_ty)
    q_pos = ctx - q_len + rows  # absolute positions of the tile's queries

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    key_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)  # keys the tile's last row sees
    for blk in range(0, tl.cdiv(key_end, BLOCK_SIZE)):
        block_id = tl.load(tables_ptr + seq * stride_tb + blk).to(tl.int64)
        k_pos = blk * BLOCK_SIZE + offs
        k, v = load_kv_block(
            cache_ptr, head_base, block_id, offs, d, k_pos < ctx, stride_c_slot, stride_c_kv,
            HEAD_DIM, BLOCK_SIZE, DOT_FP32,
        )  # fmt: skip
        # Every row sees at least key 0, so no row is fully masked (no 0/0).
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < ctx)[None, :]
        m_i, l_i, acc = softmax_step(q, k, v, visible, m_i, l_i, acc)

    out = acc / l_i[:, None]
    dst = out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qmask)


def prefill_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]: the chunks, back to back
    kv_cache: torch.Tensor,  # [2, kv_heads, slots, head_dim], this step's K/V already written
    block_tables: torch.Tensor,  # [chunks, max_blocks] int32
    q_starts: torch.Tensor,  # [chunks] int32: first row of each chunk in q
    q_lens: torch.Tensor,  # [chunks] int32
    ctx_lens: torch.Tensor,  # [chunks] int32: cached prefix + the chunk
    max_q_len: int,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    block_m: int | None = None,
) -> torch.Tensor:
    """Writes the chunks' rows of `out` ([tokens, heads, head_dim], same rows as q)."""
    chunks = q_lens.shape[0]
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[1]
    assert heads % kv_heads == 0 and q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if chunks == 0:
        return out
    block_m = block_m or (16 if interpreted() else 64)
    grid = (triton.cdiv(max_q_len, block_m), chunks, heads)
    _prefill_kernel[grid](
        q, kv_cache, out, block_tables, q_starts, q_lens, ctx_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        GROUP=heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_M=block_m,
        BLOCK_SIZE=block_size, DOT_FP32=interpreted(),
    )  # fmt: skip
    return out
