"""KV capacity: bytes per token from the seeds' formula, and sizing the pool from a budget."""

import pytest
import torch

from kvharbor.engine.config import CacheConfig
from kvharbor.engine.kv.capacity import check_max_model_len, plan_capacity
from kvharbor.engine.model.arch import ModelArch


def arch(layers, kv_heads, head_dim, heads=None):
    heads = heads or kv_heads
    return ModelArch(
        "llama",
        1000,
        heads * head_dim,
        4 * heads * head_dim,
        layers,
        heads,
        kv_heads,
        head_dim,
        1e4,
        1e-5,
        8192,
        False,
        False,
        1,
        (2,),
    )


def test_bytes_per_token_follows_the_seeds_formula(smollm):
    # 2 (K and V) x layers x kv_heads x head_dim x bytes: the lecture's 32/8/128 bf16 example is 128 KiB.
    assert arch(32, 8, 128, heads=32).kv_bytes_per_token(2) == 128 * 1024
    assert smollm.arch.kv_bytes_per_token(2) == 23_040  # SmolLM2 in bf16: 22.5 KiB
    assert smollm.arch.kv_bytes_per_token(4) == 46_080


def test_pool_is_sized_from_the_memory_budget():
    cap = plan_capacity(
        arch(30, 3, 64, 9), CacheConfig(kv_cache_memory="1GiB"), torch.bfloat16, torch.device("cpu"), max_model_len=8192
    )
    assert cap.bytes_per_token == 23_040
    assert cap.num_blocks == (1024**3) // (23_040 * 16)
    assert cap.capacity_tokens == cap.num_blocks * 16
    assert cap.total_bytes <= 1024**3


def test_an_exact_block_count_overrides_the_budget():
    cap = plan_capacity(arch(2, 2, 8), CacheConfig(num_kv_blocks=10), torch.float32, torch.device("cpu"), 160)
    assert (cap.num_blocks, cap.capacity_tokens) == (10, 160)


def test_an_asked_for_context_the_pool_cannot_hold_is_refused_with_numbers():
    with pytest.raises(ValueError, match=r"holds 10 blocks \(160 tokens.*needs 11.*--max-model-len"):
        plan_capacity(arch(2, 2, 8), CacheConfig(num_kv_blocks=10), torch.float32, torch.device("cpu"), 161)


def test_an_unasked_context_is_capped_to_the_pool():
    # The model allows 8192 tokens; 10 blocks of 16 hold 160, so that is the context served.
    cap = plan_capacity(arch(2, 2, 8), CacheConfig(num_kv_blocks=10), torch.float32, torch.device("cpu"), None)
    assert (cap.max_model_len, cap.model_limit, cap.capped) == (160, 8192, True)
    assert "capped to 160 tokens" in cap.cap_note() and "--kv-cache-memory or --num-kv-blocks" in cap.cap_note()
    roomy = plan_capacity(arch(2, 2, 8), CacheConfig(num_kv_blocks=600), torch.float32, torch.device("cpu"), None)
    assert (roomy.max_model_len, roomy.capped) == (8192, False)
    asked = plan_capacity(arch(2, 2, 8), CacheConfig(num_kv_blocks=10), torch.float32, torch.device("cpu"), 160)
    assert (asked.max_model_len, asked.capped) == (160, False)


def test_a_pool_without_room_for_any_request_is_refused():
    with pytest.raises(ValueError, match=r"holds 0 blocks.*too few for any request"):
        plan_capacity(arch(2, 2, 8), CacheConfig(kv_cache_memory="1KiB"), torch.float32, torch.device("cpu"), None)


def test_an_asked_for_context_beyond_the_models_is_refused():
    with pytest.raises(ValueError, match=r"max_model_len 9000 exceeds what m supports \(8192\)"):
        check_max_model_len(9000, 8192, "m")
    check_max_model_len(None, 8192, "m")


def test_the_default_cpu_budget_is_bounded():
    cap = plan_capacity(arch(30, 3, 64, 9), CacheConfig(), torch.bfloat16, torch.device("cpu"), 8192)
    assert 0 < cap.total_bytes <= 2 * 1024**3


def test_a_draft_models_pool_comes_out_of_the_same_budget():
    a = arch(layers=2, kv_heads=2, head_dim=64)  # 2 KiB per token in float32
    cache = CacheConfig(block_size=16, kv_cache_memory="1MiB")
    alone = plan_capacity(a, cache, torch.float32, torch.device("cpu"), 128)
    shared = plan_capacity(a, cache, torch.float32, torch.device("cpu"), 128, shadow_bytes_per_token=2048)
    assert alone.num_blocks == 32 and shared.num_blocks == 16  # same tokens in both pools, same bytes in all


def test_a_windowed_model_sizes_its_context_by_the_window_and_keeps_the_null_block_out():
    """Every layer slides (window 64): a request holds its window's blocks and one step's, plus the
    null block, so 16 blocks serve the model's whole 8,192 tokens; one block is the null block alone."""
    from dataclasses import replace

    windowed = replace(arch(2, 2, 8), architecture="mistral", sliding_window=64)
    cpu = torch.device("cpu")
    cap = plan_capacity(windowed, CacheConfig(num_kv_blocks=16), torch.float32, cpu, None, step_tokens=128)
    assert (cap.max_model_len, cap.capped) == (8192, False)  # (64 + 128 - 2) // 16 + 2 + 1 = 14 blocks
    with pytest.raises(ValueError, match=r"one 8192-token request needs 14"):
        plan_capacity(windowed, CacheConfig(num_kv_blocks=13), torch.float32, cpu, 8192, step_tokens=128)
    with pytest.raises(ValueError, match=r"holds 1 blocks.*too few for any request"):
        plan_capacity(windowed, CacheConfig(num_kv_blocks=1), torch.float32, cpu, None, step_tokens=128)
