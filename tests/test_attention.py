"""Paged attention (torch backend) against dense causal attention, with shuffled block tables,
mixed decodes and prefill chunks with and without a cached prefix; and the decode grouping."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvharbor.engine.model.attention import MAX_GROUP_POSITIONS, build_metadata, decode_groups, paged_attention

BS, KVH, G, D = 4, 2, 3, 8


def dense_reference(q_all, k_all, v_all, start):
    """Causal attention of the queries at positions start.. over keys 0..end, with GQA."""
    n = q_all.shape[0] - start
    heads = q_all.shape[1]
    k = k_all.repeat_interleave(heads // k_all.shape[1], dim=1)
    v = v_all.repeat_interleave(heads // v_all.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_all[start:], k) / D**0.5
    mask = torch.ones(n, q_all.shape[0], dtype=torch.bool).tril(start)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_matches_dense_attention(seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 64
    cache = torch.zeros(2, KVH, num_blocks * BS, D, dtype=torch.float64)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled, non-contiguous tables
    # (context already cached, new tokens): three decodes and three prefill chunks.
    shapes = [(9, 1), (30, 1), (3, 1), (0, 7), (5, 6), (16, 4)]
    seqs = []
    for cached, new in shapes:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // BS))]
        q = torch.randn(total, KVH * G, D, generator=gen, dtype=torch.float64)
        k = torch.randn(total, KVH, D, generator=gen, dtype=torch.float64)
        v = torch.randn(total, KVH, D, generator=gen, dtype=torch.float64)
        for p in range(cached):  # the prefix a previous step wrote
            slot = table[p // BS] * BS + p % BS
            cache[0, :, slot], cache[1, :, slot] = k[p], v[p]
        seqs.append((table, cached, new, q, k, v))
    meta = build_metadata(
        [s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs], 3, BS, torch.float64, torch.device("cpu")
    )
    q = torch.cat([s[3][s[1] :] for s in seqs])
    k = torch.cat([s[4][s[1] :] for s in seqs])
    v = torch.cat([s[5][s[1] :] for s in seqs])
    out = paged_attention(q, k, v, cache, meta)
    row = 0
    for _table, cached, new, qs, ks, vs in seqs:
        ref = dense_reference(qs, ks, vs, cached)
        torch.testing.assert_close(out[row : row + new], ref, rtol=1e-10, atol=1e-10)
        row += new


def test_decode_groups_cover_everything_and_respect_the_size_cap():
    lens = sorted([5, 6, 7, 40, 41, 300, 301, 302, 900, 9000])
    groups = decode_groups(lens, 16)
    assert [s for s, _ in groups] == sorted(s for s, _ in groups)
    assert sum(n for _, n in groups) == len(lens)
    assert groups[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(groups))
    for start, size in groups:
        padded = -(-lens[start + size - 1] // 16) * 16
        assert size == 1 or size * padded <= MAX_GROUP_POSITIONS
    # Very different lengths are not padded to each other.
    assert len(groups) > 1
    assert decode_groups([], 16) == [] and decode_groups([10] * 4, 16) == [(0, 4)]
