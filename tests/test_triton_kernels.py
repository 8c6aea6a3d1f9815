"""The Triton kernels (engine/kernels/) against an independent float64 torch reference, under
the Triton interpreter on CPU (TRITON_INTERPRET=1, set in conftest.py). Fresh random inputs per
case; outputs are poisoned with NaN first, so every element must be written."""

from __future__ import annotations

import math
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from kvharbor.engine.kernels import interpreted  # noqa: E402
from kvharbor.engine.kernels.decode import choose_splits, decode_attention  # noqa: E402
from kvharbor.engine.kernels.kv_write import write_kv  # noqa: E402
from kvharbor.engine.kernels.prefill import prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not interpreted() else "cpu"
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


class Paged:
    """A random paged KV cache holding sequences of the given lengths in shuffled blocks."""

    def __init__(self, lens, kv_heads, head_dim, block_size, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        self.block_size, self.lens = block_size, lens
        per_seq = [math.ceil(n / block_size) for n in lens]
        num_blocks = sum(per_seq) + 3  # spare blocks that nobody reads
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)  # non-contiguous, out of order
        self.tables = []
        for n in per_seq:
            self.tables.append(ids[:n])
            ids = ids[n:]
        width = max(per_seq)
        padded = [t + [0] * (width - len(t)) for t in self.tables]
        self.block_tables = torch.tensor(padded, dtype=torch.int32, device=DEVICE)
        self.cache = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype).to(DEVICE)

    def kv(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[kv_heads, len, dim] K and V of one sequence, gathered by slot, float64."""
        bs = self.block_size
        slots = torch.tensor([self.tables[seq][p // bs] * bs + p % bs for p in range(self.lens[seq])], device=DEVICE)
        return self.cache[0][:, slots].double(), self.cache[1][:, slots].double()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """q [n, heads, d] at absolute positions q_pos; k, v [kv_heads, ctx, d]; float64, causal."""
    heads, kv_heads = q.shape[1], k.shape[0]
    k = k.repeat_interleave(heads // kv_heads, 0)
    v = v.repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("nhd,hkd->hnk", q.double(), k) / math.sqrt(q.shape[-1])
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnk,hkd->nhd", scores.softmax(-1), v)


CASES = [
    # (lens, heads, kv_heads, head_dim, block_size, dtype)
    ([1], 4, 4, 64, 16, torch.float32),  # length 1, GQA ratio 1
    ([32, 16], 6, 2, 64, 16, torch.float32),  # exact multiples of the block, ratio 3
    ([37, 5, 70, 1, 16], 8, 1, 64, 16, torch.float32),  # mixed, partial last blocks, ratio 8
    ([33, 64], 16, 2, 128, 32, torch.float32),  # head_dim 128, block 32, ratio 8
    ([45, 3], 3, 1, 128, 32, torch.float16),
    ([50, 17], 4, 2, 64, 16, torch.bfloat16),
]


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "head_dim", "block_size", "dtype"), CASES)
def test_decode_attention_matches_the_reference(lens, heads, kv_heads, head_dim, block_size, dtype):
    paged = Paged(lens, kv_heads, head_dim, block_size, dtype, seed=len(lens) * 7 + head_dim)
    q = torch.randn(len(lens), heads, head_dim).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    decode_attention(q, paged.cache, paged.block_tables, ctx, block_size, head_dim**-0.5, out=out)
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        ref = reference(q[i : i + 1], *paged.kv(i), torch.tensor([n - 1], device=DEVICE))
        assert rel_err(out[i : i + 1], ref) < TOL[dtype], f"sequence {i} (length {n})"


@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv_decode_matches_the_reference(splits):
    lens = [1, 40, 130, 97]  # with 3 splits of 3 blocks, short sequences leave splits empty
    paged = Paged(lens, 2, 64, 16, torch.float32, seed=splits)
    q = torch.randn(len(lens), 8, 64, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    decode_attention(q, paged.cache, paged.block_tables, ctx, 16, 64**-0.5, splits=splits, out=out)
    for i, n in enumerate(lens):
        ref = reference(q[i : i + 1], *paged.kv(i), torch.tensor([n - 1], device=DEVICE))
        assert rel_err(out[i : i + 1], ref) < 1e-3, f"sequence {i} (length {n})"


def test_split_heuristic_splits_only_a_grid_too_small_for_the_gpu():
    assert choose_splits(1, 8, 32768, 16, num_sms=132) > 1  # one long sequence: split it
    assert choose_splits(64, 8, 32768, 16, num_sms=132) == 1  # 512 programs already fill 132 SMs
    assert choose_splits(1, 8, 64, 16, num_sms=132) == 1  # too short to be worth it
    assert choose_splits(1, 8, 32768, 16, num_sms=None) == 1  # no GPU
    assert choose_splits(1, 1, 10**6, 16, num_sms=132) <= 64


@pytest.mark.parametrize(
    ("chunks", "heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [
        ([(5, 5)], 4, 4, 64, 16, torch.float32),  # a fresh prompt shorter than a block
        ([(16, 32), (1, 9), (20, 20)], 6, 2, 64, 16, torch.float32),  # chunks after cached prefixes
        ([(33, 70), (7, 7)], 8, 1, 128, 32, torch.float32),  # rows past one query tile
        ([(12, 40), (3, 3)], 4, 2, 64, 16, torch.bfloat16),
    ],
)
def test_chunked_prefill_attention_matches_the_reference(chunks, heads, kv_heads, head_dim, block_size, dtype):
    """chunks: (q_len, ctx_len); the chunk's tokens are the last q_len of its context."""
    paged = Paged([c for _, c in chunks], kv_heads, head_dim, block_size, dtype, seed=len(chunks) + head_dim)
    total = sum(q for q, _ in chunks)
    q = torch.randn(total + 2, heads, head_dim).to(dtype).to(DEVICE)  # two rows that are not ours
    out = torch.full_like(q, float("nan"))
    starts = [sum(n for n, _ in chunks[:i]) + 1 for i in range(len(chunks))]
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    prefill_attention(
        q, paged.cache, paged.block_tables, as_int(starts), as_int([n for n, _ in chunks]),
        as_int([c for _, c in chunks]), max(n for n, _ in chunks), block_size, head_dim**-0.5, out,
    )  # fmt: skip
    assert out[0].isnan().all() and out[-1].isnan().all()  # rows outside the chunks untouched
    for i, (n, c) in enumerate(chunks):
        rows = slice(starts[i], starts[i] + n)
        assert not out[rows].isnan().any()
        ref = reference(q[rows], *paged.kv(i), torch.arange(c - n, c, device=DEVICE))
        assert rel_err(out[rows], ref) < TOL[dtype], f"chunk {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_scatters_through_the_slot_mapping(dtype):
    cache = torch.full((2, 3, 64, 64), float("nan"), dtype=dtype, device=DEVICE)
    k = torch.randn(10, 3, 64).to(dtype).to(DEVICE)
    v = torch.randn(10, 3, 64).to(dtype).to(DEVICE)
    slots = torch.tensor(random.Random(1).sample(range(64), 10), dtype=torch.long, device=DEVICE)
    slots[4] = -1  # padding: written nowhere
    write_kv(k, v, cache, slots)
    keep = slots >= 0
    assert torch.equal(cache[0][:, slots[keep]], k[keep].transpose(0, 1))
    assert torch.equal(cache[1][:, slots[keep]], v[keep].transpose(0, 1))
    assert cache.isnan().sum() == 2 * 3 * 64 * (64 - 9)  # nothing else was touched


def _greedy(case, backend: str) -> list[tuple[list[int], list[float]]]:
    from kvharbor.engine import LLM, SamplingParams

    llm = LLM(
        loaded_model=case.loaded, dtype="float32", device="cpu", attention_backend=backend,
        num_kv_blocks=64, block_size=16, max_num_batched_tokens=48,  # chunked prefills, cached prefixes
    )  # fmt: skip
    prompts = case.prompts[:2] + case.shared_prompts[:2]  # the shared ones reuse a cached prefix
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.core.attention_backend == backend
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.slow  # ~10 s here under the Triton interpreter
def test_the_engine_with_triton_attention_generates_the_torch_backends_tokens(tiny_llama):
    torch_out = _greedy(tiny_llama, "torch")
    triton_out = _greedy(tiny_llama, "triton")
    for (t_tokens, t_lps), (k_tokens, k_lps) in zip(torch_out, triton_out, strict=True):
        assert k_tokens == t_tokens
        assert max(abs(a - b) for a, b in zip(t_lps, k_lps, strict=True)) < 1e-3


def test_backend_choice_and_its_errors():
    from kvharbor.engine.model.attention_triton import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, 16) == "torch"
    assert resolve_backend("triton", cpu, 16) == "triton"  # under TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="block_size >= 16"):
        resolve_backend("triton", cpu, 8)
    with pytest.raises(ValueError, match="one of auto, torch, triton"):
        resolve_backend("cuda", cpu, 16)
    assert resolve_backend("auto", torch.device("cuda"), 16, kv_dtype="int8") == "torch"  # 8-bit KV: no Triton
    with pytest.raises(ValueError, match="torch attention backend"):
        resolve_backend("triton", cpu, 16, kv_dtype="fp8")


def test_backend_is_a_flag_an_env_variable_and_a_yaml_key():
    from kvharbor.common.config import config_from_argv, load_config
    from kvharbor.engine.config import EngineConfig, ServeConfig

    argv = ["--attention-backend", "triton"]
    assert config_from_argv(ServeConfig, argv, "t", "t").engine.runtime.attention_backend == "triton"
    from_env = load_config(EngineConfig, env={"KVHARBOR_ATTENTION_BACKEND": "torch"})
    assert from_env.runtime.attention_backend == "torch"
    with pytest.raises(ValueError):
        load_config(EngineConfig, env={}, overrides={"attention_backend": "cuda"})


def test_no_decodes_means_one_split_even_on_a_gpu():
    # A prefill-only step on CUDA: nothing to split (this divided by zero once).
    assert choose_splits(0, 8, 0, 16, num_sms=132) == 1
