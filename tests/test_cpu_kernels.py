"""kvharbor's float32 CPU kernels (engine/cpu/csrc/cpu_kernels.c) against float64 references: the
decode linears, paged decode attention and the layers' pointwise ops; the build cache, the fallback where nothing can be
built, a forked child, and the engine's tokens with the kernels on and off."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

from kvharbor.engine import SamplingParams
from kvharbor.engine.cpu import cpu_kernels

THREADS = 2
KERNELS = cpu_kernels.load(THREADS)
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the AVX2 kernels cannot run or build here")


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 13), (24, 576), (100, 37), (1000, 64)])
def test_linear_matches_float64(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    wide = torch.randn(m, k + 5, generator=gen)
    x = wide[:, 2 : 2 + k]  # rows strided, as a slice of a fused projection's output
    for b in (None, bias):
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = KERNELS.linear(x, w, b)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 65, 300])
def test_a_skinny_linear_takes_every_row_count(rows):
    """Decode rows through the kernel, prefill rows through oneDNN's packed copy (or F.linear)."""
    from kvharbor.engine.cpu import cpu_linear

    gen = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    packed = cpu_linear.pack(w, 128) if cpu_linear.packing_available(torch.float32, torch.device("cpu")) else None
    for linear in (cpu_kernels.SkinnyLinear(KERNELS, w, packed), cpu_kernels.SkinnyLinear(KERNELS, w)):
        want = F.linear(x.double(), w.double(), bias.double())
        assert (linear(x, bias).double() - want).abs().max() <= 1e-4


def reference_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, scale=None, window=0, softcap=0.0):
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(ctx_lens.tolist()):
        first = max(0, n - window) if window else 0
        slots = [tables[b, t // block_size].item() * block_size + t % block_size for t in range(first, n)]
        keys = k_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [heads, n, dim]
        values = v_cache[:, slots].double().repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].double(), keys) * (scale or q.shape[-1] ** -0.5)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[b] = torch.einsum("hn,hnd->hd", scores.softmax(-1), values)
    return out


@needs_kernels
# GQA groups of 3 (SmolLM2), 1, 4 and 7 (the kernel takes a group's heads 3 at a time: 3 + 1, 3 + 3
# + 1), dims of 8, 40 (a 32-float chunk and an 8-float tail), 64 and 128.
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 8, 4), (8, 2, 128, 16), (14, 2, 40, 16)])  # fmt: skip
def test_decode_attention_matches_float64(heads, kv_heads, dim, block_size):
    gen = torch.Generator().manual_seed(heads + dim)
    num_blocks = 40
    k_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen)
    ctx_lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 70, 5], dtype=torch.int32)
    width = max(-(-int(n) // block_size) for n in ctx_lens)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in ctx_lens]).to(torch.int32)
    q = torch.randn(len(ctx_lens), heads + 2 * kv_heads, dim, generator=gen)[:, :heads]  # a fused qkv slice
    out = torch.full((len(ctx_lens), heads, dim), float("nan"))
    KERNELS.decode_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, out)
    want = reference_attention(q, k_cache, v_cache, tables, ctx_lens, block_size)
    assert (out.double() - want).abs().max() <= 1e-5


@needs_kernels
@pytest.mark.parametrize(("window", "scale", "softcap"), [(5, None, 0.0), (16, 0.3, 0.0), (1, None, 0.0),
                                                         (0, None, 2.0), (20, 0.2, 3.0)])  # fmt: skip
def test_decode_attention_windows_scales_and_soft_caps_match_float64(window, scale, softcap):
    """Sliding-window layers (Mistral, Gemma), Gemma's query_pre_attn_scalar and Gemma 2's soft-cap."""
    heads, kv_heads, dim, block_size, num_blocks = 8, 1, 32, 16, 12
    gen = torch.Generator().manual_seed(window + 7)
    k_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen) * 2
    v_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen)
    ctx_lens = torch.tensor([1, 5, 6, 17, 40, 70], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:5] for _ in ctx_lens]).to(torch.int32)
    q = torch.randn(len(ctx_lens), heads, dim, generator=gen)
    out = torch.empty(len(ctx_lens), heads, dim)
    KERNELS.decode_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, out, scale, window, softcap)
    want = reference_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, scale, window, softcap)
    assert (out.double() - want).abs().max() <= 1e-5
    full = reference_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, scale)
    assert (out.double() - full).abs().max() > 1e-2  # the window, cap or scale did bind


@needs_kernels
def test_decode_attention_reads_bfloat16_rows_and_each_query_alone_gives_the_same_bits():
    heads, kv_heads, dim, block_size, num_blocks = 9, 3, 64, 16, 12
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).bfloat16()
    v_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).bfloat16()
    ctx_lens = torch.tensor([1, 17, 40, 70, 33], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:5] for _ in ctx_lens]).to(torch.int32)
    q = torch.randn(len(ctx_lens), heads, dim, generator=gen)
    out = torch.empty(len(ctx_lens), heads, dim)
    KERNELS.decode_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, out)
    assert (out.double() - reference_attention(q, k_cache, v_cache, tables, ctx_lens, block_size)).abs().max() <= 1e-5
    for b in range(len(ctx_lens)):  # batch-invariant mode relies on this: a query's bits ignore the others
        one = torch.empty(1, heads, dim)
        row = slice(b, b + 1)
        KERNELS.decode_attention(q[row], k_cache, v_cache, tables[row], ctx_lens[row], block_size, one)
        assert torch.equal(one[0], out[b])
    with pytest.raises(ValueError, match="float32"):
        KERNELS.decode_attention(q.bfloat16(), k_cache, v_cache, tables, ctx_lens, block_size, out)
    with pytest.raises(ValueError, match="rows"):
        KERNELS.decode_attention(q, k_cache, v_cache.float(), tables, ctx_lens, block_size, out)


def prompt_rows(lengths: list[tuple[int, int]], num_blocks: int, block_size: int, gen) -> tuple:
    """Prefill rows of several sequences, (start, n) each: every row its sequence's table, its
    context up to its own position; and the runs that group each sequence's rows."""
    tables, ctx_lens, runs = [], [], [0]
    for start, n in lengths:
        table = torch.randperm(num_blocks, generator=gen)[: -(-(start + n) // block_size)]
        table = torch.cat([table, table.new_zeros(num_blocks - len(table))])
        tables += [table] * n
        ctx_lens += range(start + 1, start + n + 1)
        runs.append(runs[-1] + n)
    return (torch.stack(tables).to(torch.int32), torch.tensor(ctx_lens, dtype=torch.int32),
            torch.tensor(runs, dtype=torch.int64))  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("heads", "kv_heads", "window", "softcap"), [(9, 3, 0, 0.0), (16, 1, 0, 0.0), (8, 2, 21, 0.0),
                                                                     (4, 4, 7, 3.0)])  # fmt: skip
def test_prompt_rows_in_tiles_give_each_query_its_bits_alone(kv_dtype, heads, kv_heads, window, softcap):
    """A prompt's rows attended in tiles that share their K/V reads (runs: up to 16 rows, or
    48 query heads, a tile) give every query the bits it gets alone, as a decode row, and match
    float64: windows cut mid-block, tiles of 3 rows (16 heads per KV head), chunks with a cached
    start, a one-row run."""
    dim, block_size, num_blocks = 32, 16, 20
    gen = torch.Generator().manual_seed(heads + window)
    k_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=gen).to(kv_dtype)
    tables, ctx_lens, runs = prompt_rows([(0, 45), (37, 20), (100, 1), (3, 17)], num_blocks, block_size, gen)
    q = torch.randn(len(ctx_lens), heads, dim, generator=gen)
    tiled = torch.empty(len(ctx_lens), heads, dim)
    how = dict(window=window, softcap=softcap)
    KERNELS.decode_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, tiled, runs=runs, **how)
    want = reference_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, None, window, softcap)
    assert (tiled.double() - want).abs().max() <= 1e-5
    alone = torch.empty_like(tiled)
    KERNELS.decode_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, alone, **how)  # a tile per row
    assert torch.equal(tiled, alone)
    for row in (0, 44, 45, 64, 65, 81):
        one = torch.empty(1, heads, dim)
        part = slice(row, row + 1)
        KERNELS.decode_attention(q[part], k_cache, v_cache, tables[part], ctx_lens[part], block_size, one, **how)
        assert torch.equal(one[0], tiled[row])
    with pytest.raises(ValueError, match="runs"):
        KERNELS.decode_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, tiled, runs=runs[:-1], **how)


@needs_kernels
@pytest.mark.parametrize(("n", "k"), [(1, 8), (7, 13), (1000, 64), (96, 576)])
def test_a_bfloat16_weight_gives_float32_sums_the_same_for_any_row_count(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(37, k + 3, generator=gen)[:, 1 : 1 + k]  # strided rows
    got = KERNELS.linear_bf16(x, w, bias)
    want = F.linear(x.double(), w.double(), bias.double())  # the weight's exact values: no rounding but the sums'
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    for rows in (1, 2, 3, 5, 16, 17):
        assert torch.equal(KERNELS.linear_bf16(x[:rows], w, bias), got[:rows])
    with pytest.raises(ValueError, match="bfloat16"):
        KERNELS.linear_bf16(x, w.float())


@needs_kernels
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize(("n", "k"), [(7, 13), (50, 37), (96, 576), (40, 600)])  # k % 16: 13, 5, 0, 8
def test_both_lane_widths_match_float64_and_give_each_row_its_bits_alone(lanes, n, k):
    """Float32 and bfloat16 weights on 8 lanes (AVX2) and on 16 (AVX-512F, where the CPU has it):
    each against float64, and each row's result the same alone and among 1-127 others."""
    from kvharbor.common.machine import cpu_info

    before = KERNELS.lanes()
    try:
        got_lanes = KERNELS.lanes(lanes)
        assert got_lanes == (lanes if lanes == 8 or "avx512f" in cpu_info().flags else 8)
        gen = torch.Generator().manual_seed(lanes + n + k)
        x = torch.randn(128, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        for w in (torch.randn(n, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()):
            linear = KERNELS.linear if w.dtype == torch.float32 else KERNELS.linear_bf16
            got = linear(x, w, bias)
            want = F.linear(x.double(), w.double(), bias.double())
            assert (got.double() - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
            for rows in (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 127):
                assert torch.equal(linear(x[:rows], w, bias), got[:rows])
                assert torch.equal(linear(x[-rows:], w, bias), got[-rows:])
    finally:
        KERNELS.lanes(before)
    with pytest.raises(ValueError, match="8 or 16"):
        KERNELS.lanes(32)


@needs_kernels
def test_shapes_the_attention_kernel_does_not_take_are_refused():
    assert not cpu_kernels.CpuKernels.takes_attention(32, 1, 64)  # a query group over 16
    assert not cpu_kernels.CpuKernels.takes_attention(8, 2, 60)  # dim not a multiple of 8
    cache = torch.zeros(1, 16, 60)
    with pytest.raises(ValueError, match="does not take"):
        KERNELS.decode_attention(torch.zeros(1, 8, 60), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                 torch.ones(1, dtype=torch.int32), 16, torch.zeros(1, 8, 60))  # fmt: skip


@needs_kernels
@pytest.mark.slow  # runs the C compiler
def test_a_build_is_cached_by_source_and_flags(tmp_path, monkeypatch):
    # A one-line source: the caching is the point, and the real kernel takes ~10 s to compile.
    source = tmp_path / "tiny.c"
    source.write_text("int kvharbor_tiny(void) { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", (source,))
    monkeypatch.setattr(cpu_kernels, "HEADERS", ())
    cc, out = cpu_kernels._compiler(), tmp_path / "built"
    first = cpu_kernels.build(cc, out)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build(cc, out) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in out.iterdir()] == [first.name]  # no half-written file left behind
    source.write_text("int kvharbor_tiny(void) { return 2; }\n")
    second = cpu_kernels.build(cc, out)
    assert second != first and sorted(p.name for p in out.iterdir()) == sorted([first.name, second.name])
    monkeypatch.setattr(cpu_kernels, "FLAGS", (*cpu_kernels.FLAGS, "-DKVHARBOR_TEST_FLAG"))
    assert cpu_kernels.build(cc, out) not in (first, second)  # other flags: another build


@needs_kernels
@pytest.mark.slow  # forks a process
def test_a_forked_child_starts_its_own_workers():
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    want = KERNELS.linear(x, w)
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker threads are gone
        ok = torch.equal(KERNELS.linear(x, w), want)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:  # a hung child: kill it, then fail
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung in the kernel (it waited for workers it does not have)")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_without_a_compiler_the_engine_keeps_torchs_matmul(monkeypatch, caplog, tiny_llama, make_llm):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level("INFO", logger="kvharbor.engine.cpu.cpu_kernels"):
            llm = make_llm(tiny_llama.loaded)
        assert llm.engine.core.cpu_kernels is None and llm.engine.core.model.layers[0].fast["qkv"] is None
        if KERNELS is not None:  # this CPU could run them: the log says why they are not used
            assert any("no C compiler" in r.getMessage() for r in caplog.records)
        out = llm.generate([tiny_llama.prompts[2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        cpu_kernels.load.cache_clear()


@needs_kernels
def test_the_engine_gives_the_same_tokens_with_the_kernels_on_and_off(tiny_llama, make_llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    on, off = make_llm(tiny_llama.loaded), make_llm(tiny_llama.loaded, cpu_kernels=False)
    assert on.engine.core.cpu_kernels is not None and on.engine.core.model.layers[0].fast["qkv"] is not None
    assert off.engine.core.cpu_kernels is None and off.engine.core.model.layers[0].fast["qkv"] is None
    assert type(on.engine.core.model.ops).__name__ == "CpuOps"
    assert type(off.engine.core.model.ops).__name__ == "TorchOps"
    tokens = [[o.outputs[0].token_ids for o in llm.generate(tiny_llama.prompts, params)] for llm in (on, off)]
    assert tokens[0] == tokens[1]


# The pointwise kernels do in float32 what the float64 reference does, in a different order (and
# SiLU with a polynomial e^x of ~1e-7 relative error): a few float32 ulps of the result's scale.
POINTWISE_TOL = 1e-5


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("hidden", [8, 13, 576])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_matches_float64(rows, hidden, add):
    gen = torch.Generator().manual_seed(rows * 100 + hidden)
    residual, w = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(hidden, generator=gen)
    wide = torch.randn(rows, hidden + 4, generator=gen)
    x = wide[:, 1 : 1 + hidden] if add else None  # strided rows, as an o_proj slice may be
    total = residual.double() + (x.double() if add else 0)
    want = w.double() * total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5)
    got = KERNELS.add_rms_norm(x, residual, w, 1e-5)
    assert (residual.double() - total).abs().max() <= 1e-6 * total.abs().max()  # added in place
    assert (got.double() - want).abs().max() <= POINTWISE_TOL * want.abs().max()


@needs_kernels
@pytest.mark.parametrize(("heads", "dim"), [(1, 2), (3, 12), (12, 64)])
def test_rope_matches_float64_rotate_half(heads, dim):
    from kvharbor.engine.cpu.layer_ops import rotate

    gen = torch.Generator().manual_seed(heads * dim)
    rows, extra = 5, 7  # a v part (extra floats) that must stay untouched
    x = torch.randn(rows, heads * dim + extra, generator=gen)
    angles = torch.randn(rows, dim // 2, generator=gen) * 10
    cos, sin = angles.cos(), angles.sin()
    want = rotate(x[:, : heads * dim].double().view(rows, heads, dim), cos.double()[:, None], sin.double()[:, None])
    tail = x[:, heads * dim :].clone()
    KERNELS.rope(x, heads, dim, cos, sin)
    assert (x[:, : heads * dim].double().view(rows, heads, dim) - want).abs().max() <= POINTWISE_TOL * 10
    assert torch.equal(x[:, heads * dim :], tail)


GATED = {"silu_mul": lambda g: g * torch.sigmoid(g), "gelu_tanh_mul": lambda g: F.gelu(g, approximate="tanh")}


@needs_kernels
@pytest.mark.parametrize("inter", [8, 13, 1536])
@pytest.mark.parametrize("name", list(GATED))
def test_gated_activations_match_float64_also_far_out(name, inter):
    """silu (Llama's MLP) and gelu-tanh (Gemma's), each times up."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(4, 2 * inter, generator=gen) * 4
    gate_up[0, : min(inter, 6)] = torch.tensor([-120.0, -88.5, -20.0, 0.0, 88.5, 120.0])[: min(inter, 6)]
    g, u = gate_up.double().chunk(2, dim=-1)
    want = GATED[name](g) * u
    got = getattr(KERNELS, name)(gate_up)
    assert got.shape == (4, inter) and torch.isfinite(got).all()
    assert (got.double() - want).abs().max() <= POINTWISE_TOL * want.abs().max()


@needs_kernels
def test_pointwise_rows_shared_over_threads_keep_each_rows_bits():
    """From 32 rows the pointwise ops split their rows over the pool's threads (a prefill chunk in
    batch-invariant mode): each row's result is the bits it gets alone, on the calling thread."""
    gen = torch.Generator().manual_seed(9)
    rows, hidden, heads, dim, inter = 100, 96, 3, 32, 40
    residual, x = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    q = torch.randn(rows, heads * dim, generator=gen)
    angles = torch.randn(rows, dim // 2, generator=gen)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 3
    shared_res = residual.clone()
    normed = KERNELS.add_rms_norm(x, shared_res, w, 1e-5)
    rotated = q.clone()
    KERNELS.rope(rotated, heads, dim, cos, sin)
    silu, gelu = KERNELS.silu_mul(gate_up), KERNELS.gelu_tanh_mul(gate_up)
    for r in (0, 31, 32, 63, 99):
        one = slice(r, r + 1)
        res = residual[one].clone()
        assert torch.equal(KERNELS.add_rms_norm(x[one], res, w, 1e-5), normed[one])
        assert torch.equal(res, shared_res[one])
        alone = q[one].clone()
        KERNELS.rope(alone, heads, dim, cos[one], sin[one])
        assert torch.equal(alone, rotated[one])
        assert torch.equal(KERNELS.silu_mul(gate_up[one]), silu[one])
        assert torch.equal(KERNELS.gelu_tanh_mul(gate_up[one]), gelu[one])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_kv_write_copies_each_row_to_its_slot_and_checks_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(4, 3 * 2 * 8 + 5, generator=gen)  # k rows strided inside a fused projection
    qkv[0, 5:9] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(2**-130), 3.0e38])  # ties to even, a subnormal, a big one
    rows = qkv[:, 5 : 5 + 16].view(4, 2, 8)
    cache = torch.zeros(2, 40, 8, dtype=dtype)
    slots = torch.tensor([7, 0, 39, 12])
    KERNELS.kv_write(rows, slots, cache)
    want = torch.zeros(2, 40, 8, dtype=dtype)
    want.index_copy_(1, slots, rows.transpose(0, 1).to(dtype))  # a bfloat16 cache: rounded as torch rounds
    assert torch.equal(cache.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="one slot per row"):
        KERNELS.kv_write(rows, torch.tensor([7, 0, 40, 12]), cache)
    with pytest.raises(ValueError, match="one slot per row"):
        KERNELS.kv_write(rows, slots, cache, bounds=(0, 40))  # bounds given by the caller are checked too
    with pytest.raises(ValueError, match=f"contiguous {str(dtype).removeprefix('torch.')} cache"):
        KERNELS.kv_write(rows, slots, torch.zeros(2, 40, 9, dtype=dtype))


@needs_kernels
def test_linear_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="float32 weight"):
        KERNELS.linear(torch.zeros(2, 8), torch.zeros(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        KERNELS.linear(torch.zeros(2, 8), torch.zeros(8, 3).T)
    with pytest.raises(ValueError, match="float32 x"):
        KERNELS.linear(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(3, 8))


@needs_kernels
def test_pointwise_kernels_refuse_what_they_do_not_take():
    with pytest.raises(ValueError, match="float32"):
        KERNELS.add_rms_norm(None, torch.zeros(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        KERNELS.add_rms_norm(torch.zeros(2, 7), torch.zeros(2, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="cos and sin"):
        KERNELS.rope(torch.zeros(2, 16), 2, 8, torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="even dim"):
        KERNELS.rope(torch.zeros(2, 16), 2, 7, torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="gate and up"):
        KERNELS.silu_mul(torch.zeros(2, 7))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rank", "k"), [(5, 37), (16, 64), (8, 13)])  # tails past the 8- and 16-wide loops
def test_lora_decode_adds_each_rows_own_slot_delta(dtype, rank, k):
    gen = torch.Generator().manual_seed(rank * 100 + k)
    subs, slots, outs = 3, 3, [11, 4, 6]
    a = torch.randn(subs, slots, rank, k, generator=gen).to(dtype)
    bt = [torch.randn(n, slots * rank, generator=gen).to(dtype) for n in outs]
    offsets = [2, 13, 17]  # each sub's columns in a fused output of 25 (columns 0-1 and 23-24 untouched)
    plan = KERNELS.lora_plan(a, bt, offsets)
    row_slot = torch.tensor([2, -1, 0, 1, 1, -1, 2], dtype=torch.int32)
    wide = torch.randn(7, k + 3, generator=gen).to(dtype)
    x = wide[:, 1 : 1 + k]  # rows strided
    for enabled in (0b111, 0b101, 0b010):
        y = torch.randn(7, 25, generator=gen).to(dtype)
        want = y.double().clone()
        for r, slot in enumerate(row_slot.tolist()):
            for j in range(subs):
                if slot >= 0 and enabled >> j & 1:
                    b = bt[j][:, slot * rank : (slot + 1) * rank].double()
                    want[r, offsets[j] : offsets[j] + outs[j]] += x[r].double() @ a[j, slot].double().T @ b.T
        KERNELS.lora_decode(plan, x, row_slot, enabled, y)
        tol = 1e-4 if dtype == torch.float32 else 0.02 * want.abs().max().item()  # bfloat16 y: 8 bits
        torch.testing.assert_close(y.double(), want, rtol=0, atol=tol)


@needs_kernels
def test_lora_decode_refuses_what_it_does_not_take():
    a = torch.zeros(2, 2, 4, 8)
    with pytest.raises(ValueError, match="B\\^T"):
        KERNELS.lora_plan(a, [torch.zeros(3, 8)], [0, 3])
    with pytest.raises(ValueError, match="contiguous B"):
        KERNELS.lora_plan(a, [torch.zeros(3, 8), torch.zeros(3, 7)], [0, 3])
    plan = KERNELS.lora_plan(a, [torch.zeros(3, 8), torch.zeros(3, 8)], [0, 3])
    KERNELS.lora_decode(plan, torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32), 3, torch.zeros(0, 6))  # no rows
    with pytest.raises(ValueError, match="x \\[m, 8\\]"):
        KERNELS.lora_decode(plan, torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), 3,
                            torch.zeros(2, 6))  # fmt: skip
    with pytest.raises(ValueError, match="int32 slot per row"):
        KERNELS.lora_decode(plan, torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 3, torch.zeros(2, 6))
    with pytest.raises(ValueError, match="columns up to 6"):
        KERNELS.lora_decode(plan, torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), 3, torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"outside -1\.\.1"):
        KERNELS.lora_decode(plan, torch.zeros(2, 8), torch.tensor([0, 2], dtype=torch.int32), 3, torch.zeros(2, 6))


@needs_kernels
@pytest.mark.slow  # two builds of the real kernel, ~10 s each
def test_the_vnni_build_gives_the_same_quantized_products(tmp_path):
    """cpu_kernels.c's dot_u8s8: one VNNI instruction or AVX2's two give the same integer sums,
    and the build for this CPU's VNNI (AVX-VNNI, or AVX512-VNNI alone) really compiles it."""
    from kvharbor.common.machine import cpu_info
    from kvharbor.engine.quantize import quantize, quantize_q8

    extra = cpu_kernels.vnni_flags(cpu_info())
    if not extra:
        pytest.skip("this CPU has neither AVX-VNNI nor AVX512-VNNI")
    cc = cpu_kernels._compiler()
    try:
        vnni = cpu_kernels.CpuKernels(cpu_kernels.build(cc, tmp_path, (*cpu_kernels.FLAGS, *extra)), 2)
    except RuntimeError as exc:
        pytest.skip(f"the compiler does not take {extra}: {exc}")
    plain = cpu_kernels.CpuKernels(cpu_kernels.build(cc, tmp_path), 2)
    assert plain.int_dot == "maddubs"
    assert vnni.int_dot == ("avx_vnni" if extra == cpu_kernels.VNNI_FLAGS else "avx512_vnni")
    gen = torch.Generator().manual_seed(3)
    for mode in ("int8", "int4", "q8"):  # the three weight formats with integer dots (1, 2, 3)
        weight = torch.randn(70, 96, generator=gen)
        w = quantize_q8(weight) if mode == "q8" else quantize(weight, mode)
        for rows in (1, 5, 8, 32):
            x = torch.randn(rows, 96, generator=gen)
            assert torch.equal(vnni.linear_quant(x, w), plain.linear_quant(x, w)), (mode, rows)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("avx2 fma", ()),
        ("avx2 fma avx_vnni", cpu_kernels.VNNI_FLAGS),  # Alder Lake / Sapphire Rapids: the VEX form first
        ("avx2 fma avx512f avx512vl avx512_vnni avx_vnni", cpu_kernels.VNNI_FLAGS),
        ("avx2 fma avx512f avx512vl avx512_vnni", cpu_kernels.AVX512_VNNI_FLAGS),  # Zen 4, Ice Lake
        ("avx2 fma avx512f avx512_vnni", ()),  # the 256-bit form needs AVX512VL
    ],
)
def test_the_vnni_flags_follow_the_cpu(flags, expected):
    from kvharbor.common.machine import CpuInfo

    cpu = CpuInfo(model="x", arch="x86_64", flags=frozenset(flags.split()), cores=2)
    assert cpu_kernels.vnni_flags(cpu) == expected
