"""Embeddings from a decoder (engine/pooling.py): a random-weight Qwen3 embedding model, laid out as
Qwen3-Embedding ships, against transformers' pooled and normalized hidden states on the same
weights; batched against one by one; the prefix cache under last-token pooling; chunked mean
pooling; Matryoshka dimensions; the task an engine serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_embedding_model

from kvharbor.engine.model.loader import load_model
from kvharbor.engine.pooling import Pooling, model_pooling
from kvharbor.engine.sampling_params import SamplingParams

PROMPTS = [[5 + (i * 7 + j * 3) % 400 for j in range(n)] for i, n in enumerate((3, 17, 40, 65))]


@pytest.fixture(scope="module", params=["last", "mean"])
def embedder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3-embed-{request.param}")
    reference = tiny_embedding_model(path, request.param)
    return request.param, reference, load_model(str(path))


def reference_vectors(model, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
            out.append(F.normalize(pooled, dim=0))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vectors_match_transformers_pooled_and_normalized(embedder, make_llm, dtype):
    pooling, reference, loaded = embedder
    assert model_pooling(loaded.path) == Pooling(pooling, True)
    llm = make_llm(loaded, dtype=dtype, max_num_batched_tokens=32)  # chunked: 65 tokens take 3 chunks
    got = llm.embed(PROMPTS)
    tol = 1e-4 if dtype == "float32" else 3e-2
    for vector, ref in zip(got, reference_vectors(reference, PROMPTS, pooling), strict=True):
        vector = torch.tensor(vector)
        assert vector.shape == ref.shape and abs(vector.norm().item() - 1) < 1e-5
        assert torch.allclose(vector, ref, atol=tol), (vector - ref).abs().max()


def test_batched_and_one_by_one_give_the_same_vectors(embedder, make_llm):
    _, _, loaded = embedder
    llm = make_llm(loaded, enable_prefix_caching=False)
    together = llm.embed(PROMPTS)
    alone = [llm.embed([p])[0] for p in PROMPTS]
    assert together == alone  # batch-invariant kernels: bit for bit


def test_last_token_pooling_reuses_the_prefix_cache_and_mean_pooling_computes_the_whole_prompt(embedder, make_llm):
    pooling, _, loaded = embedder
    llm = make_llm(loaded, block_size=16)
    params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
    first, second = (llm.generate([PROMPTS[3]], params)[0] for _ in range(2))
    assert second.embedding == pytest.approx(first.embedding, abs=1e-5)
    assert second.num_cached_tokens == (64 if pooling == "last" else 0)


def test_dimensions_cut_then_normalize(embedder, make_llm):
    _, _, loaded = embedder
    llm = make_llm(loaded)
    whole, cut = llm.embed([PROMPTS[1]])[0], llm.embed([PROMPTS[1]], dimensions=16)[0]
    assert len(cut) == 16 and torch.allclose(torch.tensor(cut), F.normalize(torch.tensor(whole[:16]), dim=0),
                                             atol=1e-6)  # fmt: skip


def test_an_engine_serves_its_task_and_refuses_the_other(embedder, make_llm, tiny_llama):
    _, _, loaded = embedder
    embedding = make_llm(loaded)
    with pytest.raises(ValueError, match="serves embeddings"):
        embedding.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
    generating = make_llm(tiny_llama.loaded)
    with pytest.raises(ValueError, match="task generate"):
        generating.embed([PROMPTS[0]])
    forced = make_llm(tiny_llama.loaded, task="embed", pooling="mean")
    assert forced.engine.core.pooling == Pooling("mean", True) and len(forced.embed([PROMPTS[0]])[0]) == 64
