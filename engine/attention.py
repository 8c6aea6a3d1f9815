"""Paged attention, torch backend: the reference, and what runs on CPU.

The flat batch is ordered decodes first, then prefill chunks:

    tokens | d0 d1 ... d(B-1) | p0 p0 p0 ... | p1 p1 ... |
             one query each     one chunk per prefilling sequence

Each layer's KV lives in one tensor `[2 (K/V), kv_heads, num_blocks * block_size, head_dim]`
(with `--kv-cache-dtype int8|fp8`, byte rows of head_dim + 2: engine/kv/kv_quant.py):
head-major, so gathering a sequence's blocks yields `[kv_heads, ctx, head_dim]` rows that SDPA
reads without another copy; slot = block_id * block_size + offset. Every layer writes its new K/V
first, then attends, so a sequence may read blocks that another sequence of the same step is
writing (prefix hits on blocks registered this step).

NOTE (CPU speed, measured on 2 cores): SDPA with one query per sequence and `enable_gqa` is ~4x
slower than folding each KV head's query group into the query axis (q `[B, kv_heads, group, d]`),
and gathering whole blocks with index_select is ~3x faster than gathering slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvharbor.engine.kv.kv_quant import dequantize_rows, quantize_rows


@dataclass
class PrefillChunk:
    q_start: int  # first row in the flat batch
    q_len: int
    ctx_len: int  # keys: cached prefix + this chunk
    blocks: torch.Tensor | None  # block ids holding the context; None when ctx_len == q_len
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, causal aligned bottom-right


@dataclass
class DecodeGroup:
    """Decodes with similar context lengths, attended in one call (padded to the longest)."""

    start: int  # first row in the flat batch
    size: int
    blocks: torch.Tensor  # [size * max_blocks] block ids, padded with 0
    mask: torch.Tensor  # [size, 1, 1, max_blocks * block_size] additive 0 / -inf


@dataclass
class CpuDecode:
    """The first rows of the step in one call of the CPU kernel (engine/cpu/cpu_kernels.py), which
    reads the paged cache in place through the block tables: every decode, or (batch-invariant
    mode) every row, a prefill chunk's rows each with the context up to its own position."""

    kernels: Any  # cpu_kernels.CpuKernels
    tables: torch.Tensor  # [rows, max_blocks] int32, padded with 0
    ctx_lens: torch.Tensor  # [rows] int32


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    triton: Any = None  # attention_triton.TritonMetadata when the triton backend runs this step
    cpu_decode: CpuDecode | None = None  # decodes through the CPU kernel instead of decode_groups
    kv_dtype: str = "auto"  # int8 / fp8: the cache holds engine/kv/kv_quant.py's byte rows
    kv_writer: Any = None  # cpu_kernels.CpuKernels: writes float32 or int8 rows instead of torch ops
    slot_bounds: tuple[int, int] | None = None  # min and max of slot_mapping, for the writer's check


# One more decode call costs about as much as attending to this many more padded key positions
# (measured on CPU: ~0.1 ms per call vs ~0.2 us per position).
CALL_COST_POSITIONS = 512
# NOTE: a group's gathered K/V must stay in cache for SDPA to read it back: 64 sequences x 400
# positions in one call took 18.5 ms on 2 cores, the same in four calls of 16 took 6 ms.
MAX_GROUP_POSITIONS = 8192


def decode_groups(ctx_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split decodes, sorted by context length ascending, into (start, size) groups that minimize
    padded positions + CALL_COST_POSITIONS per group, each at most MAX_GROUP_POSITIONS padded
    positions unless it is a single sequence (an O(n^2) partition; n <= max_num_seqs)."""
    n = len(ctx_lens)
    padded = [-(-c // block_size) * block_size for c in ctx_lens]
    best = [0.0] + [float("inf")] * n  # best[i]: cost of grouping the first i decodes
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            size = (end - start) * padded[end - 1]
            if size > MAX_GROUP_POSITIONS and end - start > 1:
                continue
            cost = best[start] + CALL_COST_POSITIONS + size
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups = []
    end = n
    while end > 0:
        groups.append((cut[end], end - cut[end]))
        end = cut[end]
    return groups[::-1]


def build_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    lengths: list[int],
    num_decodes: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "torch",
    kv_shape: tuple[int, int] = (0, 0),  # (kv_heads, head_dim), for the triton backend
    cpu_kernels: Any = None,  # cpu_kernels.CpuKernels: decodes through its attention kernel
    kv_dtype: str = "auto",  # the cache's --kv-cache-dtype
    invariant: bool = False,  # batch-invariant: every row through cpu_kernels' kernel
) -> AttentionMetadata:
    """Metadata for sequences (decodes first) with these block tables, computed prefixes
    (`starts`) and new-token counts (`lengths`)."""
    slots: list[int] = []
    for table, start, n in zip(block_tables, starts, lengths, strict=True):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
    if invariant:
        return _invariant_metadata(block_tables, starts, lengths, num_decodes, block_size, slots, cpu_kernels, kv_dtype)
    if backend == "triton":
        from kvharbor.engine.attention_triton import build_triton_metadata

        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        tmeta = build_triton_metadata(block_tables, starts, lengths, num_decodes, block_size, *kv_shape, device)
        return AttentionMetadata(block_size, slot_mapping, num_decodes, [], [], tmeta)
    ctx_lens = [s + 1 for s in starts[:num_decodes]]
    cpu_decode = None
    if cpu_kernels is not None and num_decodes and kv_dtype in ("auto", "int8"):  # the kernel reads no fp8
        width = max(len(t) for t in block_tables[:num_decodes])
        padded = [t + [0] * (width - len(t)) for t in block_tables[:num_decodes]]
        tables, lens = torch.tensor(padded, dtype=torch.int32), torch.tensor(ctx_lens, dtype=torch.int32)
        cpu_decode = CpuDecode(cpu_kernels, tables, lens)
        ctx_lens = []  # no decode groups: the kernel takes them all
    groups = [
        _decode_group(
            start, block_tables[start : start + size], ctx_lens[start : start + size], block_size, dtype, device
        )
        for start, size in decode_groups(ctx_lens, block_size)
    ]
    prefills = []
    q_start = num_decodes
    for table, start, n in zip(block_tables[num_decodes:], starts[num_decodes:], lengths[num_decodes:], strict=True):
        if start == 0:
            prefills.append(PrefillChunk(q_start, n, n, None, None))
        else:
            used = -(-(start + n) // block_size)
            blocks = torch.tensor(table[:used], dtype=torch.long, device=device)
            mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
            prefills.append(PrefillChunk(q_start, n, start + n, blocks, mask))
        q_start += n
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    writer = cpu_kernels if kv_dtype in ("auto", "int8") else None
    return AttentionMetadata(
        block_size, slot_mapping, num_decodes, groups, prefills, cpu_decode=cpu_decode, kv_dtype=kv_dtype,
        kv_writer=writer, slot_bounds=(min(slots), max(slots)) if slots else None,
    )  # fmt: skip


def _invariant_metadata(
    block_tables: list[list[int]], starts: list[int], lengths: list[int], num_decodes: int, block_size: int,
    slots: list[int], kernels: Any, kv_dtype: str,
) -> AttentionMetadata:
    """Every row of the step through the CPU kernel, each as one query over the context up to its
    own position (written first): the same computation for a token whether it is decoded alone,
    in a batch, in a prefill chunk of any size, or recomputed after a preemption.
    NOTE: prefill attention then costs one pass over the context per row (no shared tiles): fine
    for chat-sized prompts, a visible share of a long document's prefill."""
    if kernels is None or kv_dtype == "fp8":
        raise ValueError("batch-invariant attention needs the CPU kernels and a float32, bfloat16 or int8 KV cache")
    rows = sum(lengths)
    width = max(-(-(s + n) // block_size) for s, n in zip(starts, lengths, strict=True))
    tables = torch.zeros(rows, width, dtype=torch.int32)
    ctx_lens = torch.empty(rows, dtype=torch.int32)
    r = 0
    for table, start, n in zip(block_tables, starts, lengths, strict=True):
        used = -(-(start + n) // block_size)
        tables[r : r + n, :used] = torch.tensor(table[:used], dtype=torch.int32)
        ctx_lens[r : r + n] = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
        r += n
    return AttentionMetadata(
        block_size, torch.tensor(slots, dtype=torch.long), num_decodes, [], [],
        cpu_decode=CpuDecode(kernels, tables, ctx_lens), kv_dtype=kv_dtype, kv_writer=kernels,
        slot_bounds=(min(slots), max(slots)) if slots else None,
    )  # fmt: skip


def _decode_group(
    start: int, tables: list[list[int]], ctx_lens: list[int], block_size: int, dtype: torch.dtype, device: torch.device
) -> DecodeGroup:
    width = max(len(t) for t in tables)
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device).view(-1)
    ctx = torch.tensor(ctx_lens, device=device)
    visible = torch.arange(width * block_size, device=device)[None, :] < ctx[:, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return DecodeGroup(start, len(tables), blocks, mask.view(len(tables), 1, 1, -1))


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, kv_dtype: str, dtype: torch.dtype):
    """[kv_heads, len(blocks) * block_size, dim] rows of these blocks, in order (8-bit rows
    dequantized to `dtype`)."""
    kv_heads, _, row = cache.shape
    rows = cache.view(kv_heads, -1, block_size * row).index_select(1, blocks).view(kv_heads, -1, row)
    return rows if kv_dtype == "auto" else dequantize_rows(rows, kv_dtype, dtype)


def _write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
    """Write this step's K/V at their slots; returns the K/V attention must use for them: as
    given, or (8-bit cache) as the cache holds them, so a prefix read back later from the cache
    gives what its first computation gave. Only fresh prefill chunks read them back (decodes and
    chunks with a cached prefix read the cache), so an 8-bit step without one returns None."""
    slots, writer = meta.slot_mapping, meta.kv_writer if k.dtype == torch.float32 else None
    if meta.kv_dtype == "auto":
        if writer is not None and kv_cache.dtype == torch.float32:
            writer.kv_write(k, slots, kv_cache[0], meta.slot_bounds)
            writer.kv_write(v, slots, kv_cache[1], meta.slot_bounds)
        else:  # (float32 activations into a bfloat16 cache: batch-invariant bfloat16)
            kv_cache[0].index_copy_(1, slots, k.transpose(0, 1).to(kv_cache.dtype))
            kv_cache[1].index_copy_(1, slots, v.transpose(0, 1).to(kv_cache.dtype))
        return k, v
    if writer is not None:  # the AVX2 kernel: the same bytes
        writer.kv_write_int8(k, slots, kv_cache[0], meta.slot_bounds)
        writer.kv_write_int8(v, slots, kv_cache[1], meta.slot_bounds)
        k_rows = v_rows = None
    else:
        k_rows, v_rows = quantize_rows(k, meta.kv_dtype), quantize_rows(v, meta.kv_dtype)
        kv_cache[0].index_copy_(1, slots, k_rows.transpose(0, 1))
        kv_cache[1].index_copy_(1, slots, v_rows.transpose(0, 1))
    if not any(p.blocks is None for p in meta.prefills):
        return None, None
    if k_rows is None:  # written by the kernel: read this step's rows back
        k_rows = kv_cache[0].index_select(1, slots).transpose(0, 1)
        v_rows = kv_cache[1].index_select(1, slots).transpose(0, 1)
    return dequantize_rows(k_rows, meta.kv_dtype, k.dtype), dequantize_rows(v_rows, meta.kv_dtype, v.dtype)


def paged_attention(
    q: torch.Tensor,  # [T, heads, dim]
    k: torch.Tensor,  # [T, kv_heads, dim]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, kv_heads, slots, dim]
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, heads, dim]."""
    if meta.triton is not None:
        from kvharbor.engine.attention_triton import triton_paged_attention

        return triton_paged_attention(
            q, k, v, kv_cache, meta.slot_mapping, meta.num_decodes, meta.block_size, meta.triton
        )
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    kv_heads = k.shape[1]
    k, v = _write(kv_cache, k, v, meta)
    kvd = meta.kv_dtype
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    bs = meta.block_size
    if (cpu := meta.cpu_decode) is not None:
        n = cpu.tables.shape[0]
        if q.dtype == torch.float32:
            cpu.kernels.decode_attention(q[:n], k_cache, v_cache, cpu.tables, cpu.ctx_lens, bs, out[:n])
        else:  # bfloat16: the kernel takes float32 queries (widened exactly) and writes float32
            o = torch.empty(n, heads, dim, dtype=torch.float32)
            cpu.kernels.decode_attention(q[:n].float(), k_cache, v_cache, cpu.tables, cpu.ctx_lens, bs, o)
            out[:n] = o
    for g in meta.decode_groups:
        rows = slice(g.start, g.start + g.size)
        keys = _gather(k_cache, g.blocks, bs, kvd, q.dtype).view(kv_heads, g.size, -1, dim).transpose(0, 1)
        values = _gather(v_cache, g.blocks, bs, kvd, q.dtype).view(kv_heads, g.size, -1, dim).transpose(0, 1)
        query = q[rows].view(g.size, kv_heads, heads // kv_heads, dim)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=g.mask)
        out[rows] = o.reshape(g.size, heads, dim)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.blocks is None:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys = _gather(k_cache, p.blocks, bs, kvd, q.dtype)[:, : p.ctx_len]
            values = _gather(v_cache, p.blocks, bs, kvd, q.dtype)[:, : p.ctx_len]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            enable_gqa=True,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
