"""LoRAStep.apply against each row's own delta, x A^T B^T, computed row by row in float64: decode
rows through the masked product, prefill segments of uneven lengths (so pieces are padded) through
the batched one, adapters of different ranks and targets, and base-model rows left untouched;
in float32 and bfloat16, through torch's products and through the AVX2 kernel (decode rows)."""

from __future__ import annotations

import pytest
import torch

from kvharbor.engine.cpu import cpu_kernels
from kvharbor.engine.lora import lora_slots
from kvharbor.engine.lora.adapter import LoRAAdapter, sub_shapes
from kvharbor.engine.lora.lora_slots import MODULES_OF, LoRASlots, LoRAStep
from kvharbor.engine.model.arch import ModelArch

ARCH = ModelArch(
    architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
    max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False, bos_token_id=None,
    eos_token_ids=(0,),
)  # fmt: skip
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter(name: str, rank: int, modules: tuple[str, ...], seed: int) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(ARCH.num_layers):
        for module in modules:
            shape = sub_shapes(ARCH)[module]
            a = torch.randn(rank, shape.d_in, generator=gen)
            weights[(layer, module)] = (a, torch.randn(shape.d_out, rank, generator=gen))
    return LoRAAdapter(name, "/nowhere", rank, 1.0, name, weights)


ADAPTERS = [adapter("attn", 2, ("q_proj", "v_proj"), 1), adapter("mlp", 4, ALL[4:], 2), adapter("all", 8, ALL, 3)]


@pytest.fixture(scope="module", params=[(b, d) for b in ("torch", "kernel") for d in (torch.float32, torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def slots(request):
    backend, dtype = request.param
    kernels = None
    if backend == "kernel":
        kernels = cpu_kernels.load(2)  # the thread count is the process's: as tests/test_cpu_kernels.py
        if kernels is None:
            pytest.skip("the AVX2 kernels do not run on this machine")
    slots = LoRASlots(ARCH, num_slots=3, max_rank=8, dtype=dtype, device=torch.device("cpu"), kernels=kernels)
    for slot, each in enumerate(ADAPTERS):
        slots.write(slot, each)
    return slots


def expected(x: torch.Tensor, row_adapters: list[int], layer: int, projection: str) -> torch.Tensor:
    shapes = sub_shapes(ARCH)
    width = sum(shapes[m].d_out for m in MODULES_OF[projection])
    out = torch.zeros(x.shape[0], width, dtype=torch.float64)
    for row, index in enumerate(row_adapters):
        if index < 0:
            continue
        for module in MODULES_OF[projection]:
            if (layer, module) in ADAPTERS[index].weights:
                a, b = (t.double() for t in ADAPTERS[index].weights[(layer, module)])
                cols = slice(shapes[module].offset, shapes[module].offset + shapes[module].d_out)
                out[row, cols] = x[row].double() @ a.T @ b.T
    return out


# (tokens, slot) per chunk, the first `decode` chunks one token each.
STEPS = {
    "decode only": ([(1, 0), (1, -1), (1, 2), (1, 1)], 4),
    "uneven segments": ([(1, 2), (1, -1), (5, 1), (3, -1), (9, 0), (2, 2), (1, 2)], 2),
    "segments only": ([(7, 2), (4, -1), (11, 1)], 0),
    "decode on fewer slots": ([(1, 0), (1, 1), (6, 2)], 2),
    "segments back to back": ([(8, 1), (4, 2), (4, 0)], 0),  # pieces of 4 rows lie in batch order
    "decode on slot 0 only": ([(1, 0), (1, -1), (1, 0), (5, 2)], 3),  # torch's strided path: 2 x used < slots
}


@pytest.mark.parametrize("piece_rows", [4, 64])
@pytest.mark.parametrize("case", STEPS)
def test_each_row_gets_its_own_adapters_delta(slots, case, piece_rows, monkeypatch):
    model_dtype = slots.dtype
    monkeypatch.setattr(lora_slots, "PIECE_ROWS", piece_rows)
    chunks, decode = STEPS[case]
    step = LoRAStep.build(slots, chunks, decode)
    row_adapters = [slot for tokens, slot in chunks for _ in range(tokens)]
    gen = torch.Generator().manual_seed(7)
    for layer in range(ARCH.num_layers):
        for projection in MODULES_OF:
            d_in = sub_shapes(ARCH)[MODULES_OF[projection][0]].d_in
            x = torch.randn(len(row_adapters), d_in, generator=gen).to(model_dtype)
            width = sum(sub_shapes(ARCH)[m].d_out for m in MODULES_OF[projection])
            before = torch.randn(len(row_adapters), width, generator=gen).to(model_dtype)
            y = before.clone()
            step.apply(layer, projection, x, y)
            want = before.double() + expected(x, row_adapters, layer, projection)
            # bfloat16 products keep 8 bits: errors scale with the largest terms, not each output
            atol = 1e-4 if model_dtype == torch.float32 else 0.01 * want.abs().max().item()
            torch.testing.assert_close(y.double(), want, rtol=1e-5 if model_dtype == torch.float32 else 0.01, atol=atol)


def test_a_step_of_base_rows_only_has_no_lora_work(slots):
    assert LoRAStep.build(slots, [(1, -1), (8, -1)], 1) is None
