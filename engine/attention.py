"""Paged attention, torch backend: the reference, and what runs on CPU.

The flat batch is ordered decodes first, then prefill chunks:

    tokens | d0 d1 ... d(B-1) | p0 p0 p0 ... | p1 p1 ... |
             one query each     one chunk per prefilling sequence

KV lives in one tensor per layer viewed as slots `[num_blocks * block_size, kv_heads, head_dim]`;
slot = block_id * block_size + offset. Every layer writes its new K/V first, then attends, so a
sequence may read blocks another sequence of the same step is writing (prefix hits on blocks
registered this step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    q_start: int  # first row in the flat batch
    q_len: int
    ctx_len: int  # keys: cached prefix + this chunk
    slots: torch.Tensor | None  # [ctx_len] slot ids; None when ctx_len == q_len (use the fresh K/V)
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, causal aligned bottom-right


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_ctx] slot ids, padded with 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool; None if no padding
    prefills: list[PrefillChunk]


def build_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    lengths: list[int],
    num_decodes: int,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences (decodes first) with these block tables, computed prefixes
    (`starts`) and new-token counts (`lengths`)."""
    offsets = torch.arange(block_size, device=device)
    slot_parts, prefills = [], []
    decode_slots = decode_mask = None
    if num_decodes:
        max_blocks = max(len(t) for t in block_tables[:num_decodes])
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables[:num_decodes]], device=device)
        slots = (table[:, :, None] * block_size + offsets).view(num_decodes, -1)
        ctx = torch.tensor([s + 1 for s in starts[:num_decodes]], device=device)
        max_ctx = int(ctx.max())
        decode_slots = slots[:, :max_ctx]
        slot_parts.append(decode_slots.gather(1, (ctx - 1)[:, None]).view(-1))
        if int(ctx.min()) != max_ctx:
            decode_mask = (torch.arange(max_ctx, device=device)[None, :] < ctx[:, None]).view(num_decodes, 1, 1, -1)
    q_start = num_decodes
    for table, start, n in zip(block_tables[num_decodes:], starts[num_decodes:], lengths[num_decodes:], strict=True):
        ids = torch.tensor(table, device=device)
        all_slots = (ids[:, None] * block_size + offsets).view(-1)[: start + n]
        slot_parts.append(all_slots[start:])
        if start == 0:
            prefills.append(PrefillChunk(q_start, n, n, None, None))
        else:
            mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)
            prefills.append(PrefillChunk(q_start, n, start + n, all_slots, mask))
        q_start += n
    return AttentionMetadata(torch.cat(slot_parts), num_decodes, decode_slots, decode_mask, prefills)


def paged_attention(
    q: torch.Tensor,  # [T, heads, dim]
    k: torch.Tensor,  # [T, kv_heads, dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, heads, dim]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # [B, kv_heads, ctx, dim]
        values = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
        )
        out[:nd] = o.squeeze(2)
    for p in meta.prefills:
        rows = slice(p.q_start, p.q_start + p.q_len)
        if p.slots is None:
            keys, values = k[rows], v[rows]
        else:
            keys, values = k_cache[p.slots], v_cache[p.slots]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            enable_gqa=True,
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
