"""Shared fixtures: the real SmolLM2 (loaded once), random-weight tiny Llama/Qwen2 folders built
from transformers configs, Hugging Face reference models, and an engine factory whose teardown
proves every block went back to the pool."""

from __future__ import annotations

import inspect
import os

# Spinning OpenMP workers slow CPU decoding ~10x on a busy 2-core machine; set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton kernels run under the interpreter here (no GPU); it must be set before they are decorated.
# On a CUDA machine, TRITON_INTERPRET=0 runs the same tests on the GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from process_guard import pytest_configure, pytest_unconfigure  # noqa: F401 - the tiers' guard, as hooks
from tiny_models import TINY, hf_model, longrope

from kvharbor.engine import LLM
from kvharbor.engine.model.hf_reference import hf_reference_model
from kvharbor.engine.model.loader import LoadedModel, load_model

torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


def pytest_sessionstart(session):
    # The CPU kernels compile on first use; do it here, before any test, so that no fast-tier test
    # starts the C compiler (the process guard would fail it). A machine that cannot build them
    # simply runs without them, as users' machines do.
    from kvharbor.engine.cpu import cpu_kernels
    from kvharbor.engine.model.device import physical_cores

    cpu_kernels.load(physical_cores())
    # matplotlib builds its font cache on first import, running fc-list: on a fresh machine (CI's)
    # that would fail whichever fast-tier test plots first. Built here, before any test.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager


def pytest_sessionfinish(session):
    """Gather the session's tables; an xdist worker hands them to the controller."""
    import json
    import sys

    import session_report

    loaded = sys.modules.get("fault_load")
    if loaded is not None and loaded.ROWS:
        session_report.add("fault suite (tests/faults): one row per fault, under load", loaded.table(loaded.ROWS))
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["kvharbor_reports"] = json.dumps(session_report.REPORTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: a worker finished; keep its tables for the summary."""
    import json

    import session_report

    for title, text in json.loads(getattr(node, "workeroutput", {}).get("kvharbor_reports", "[]")):
        session_report.add(title, text)


def pytest_terminal_summary(terminalreporter):
    """The tables tests left (tests/session_report.py): the fault suite's, the fuzzers'."""
    import session_report

    for title, text in session_report.REPORTS:
        terminalreporter.write_sep("-", title)
        terminalreporter.write_line(text)


@dataclass
class ModelCase:
    """One model under test, with its independent reference."""

    name: str
    loaded: LoadedModel
    hf: torch.nn.Module  # transformers model, float32, same weights
    prompts: list[list[int]]  # 8 prompts of mixed lengths
    shared_prompts: list[list[int]]  # 8 prompts that share a long prefix


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory) -> Path:
    """The bundled Gemma 3 270M GGUF (the test extra installs its packages), joined once per worker."""
    from kvharbor.common.model_files import GEMMA3_270M, chunked_model_path

    return chunked_model_path(GEMMA3_270M, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model(None)


SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of 3 colors: red, green and",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is 17 + 25?\nA:",
    "Translate to French: 'Good morning, my friend.'\nFrench:",
    "The three primary colors are",
    "import numpy as np\nx = np.arange(10)\nprint(",
]
SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in one short sentence, "
    "cite the policy section when you can, and never invent tracking numbers."
)
QUESTIONS = [
    "Where is my parcel?",
    "Can I change the delivery address?",
    "How long does express shipping take?",
    "Do you ship to Norway?",
    "What if the box arrives damaged?",
    "Can I pay on delivery?",
    "Is Saturday delivery possible?",
    "How do I return an item?",
]


@pytest.fixture(scope="session")
def smollm_case(smollm) -> ModelCase:
    tok = smollm.tokenizer
    prompts = [tok.encode(t) for t in SMOL_TEXTS]
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    shared = [tok.encode_chat(chat) for chat in chats]
    return ModelCase("smollm2", smollm, hf_reference_model(smollm), prompts, shared)


def _tiny_case(tmp_path_factory, kind: str) -> ModelCase:
    if kind == "llama":
        model = hf_model("llama", 1234, **TINY, rope_theta=10000.0, tie_word_embeddings=False)
    elif kind == "qwen2":
        model = hf_model("qwen2", 4321, **TINY, rope_theta=1e6, tie_word_embeddings=True)
    elif kind == "qwen3":  # q/k norm, GQA 4:1, a head_dim (32) other than hidden / heads (8)
        shape = {**TINY, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}
        model = hf_model("qwen3", 2468, **shape, rope_theta=1e6, tie_word_embeddings=True)
    elif kind == "phi3":  # fused q/k/v and gate/up, GQA 1:1, LongRoPE with an attention factor (max 4x original)
        rope = longrope(TINY["hidden_size"] // 4, original=512)
        shape = {**TINY, "num_key_value_heads": 4, "max_position_embeddings": 2048, "pad_token_id": 0,
                 "original_max_position_embeddings": 512}  # fmt: skip
        model = hf_model("phi3", 1357, **shape, rope_parameters=rope, sliding_window=None, tie_word_embeddings=False)
    else:
        model = _tiny_windowed(kind)
    path = tmp_path_factory.mktemp(f"tiny-{kind}")
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (int(n),), generator=gen).tolist() for n in (5, 16, 17, 33, 40, 64, 70, 100)]
    prefix = torch.randint(3, 512, (37,), generator=gen).tolist()
    shared = [prefix + torch.randint(3, 512, (3 + 2 * i,), generator=gen).tolist() for i in range(8)]
    return ModelCase(f"tiny-{kind}", load_model(str(path)), model, prompts, shared)


# Windows of 20-24 tokens: shorter than most test prompts, so every scheduling situation (chunks,
# prefix hits, preemption) runs with the window binding.
def _tiny_windowed(kind: str) -> torch.nn.Module:
    if kind == "mistral-window":  # every layer windowed
        return hf_model("mistral", 9753, **TINY, rope_theta=10000.0, sliding_window=20, tie_word_embeddings=False)
    if kind == "gemma3":  # q/k norm, sandwich norms, gelu, GQA 8:1, head_dim 32 != 64 / 8, scale from
        # query_pre_attn_scalar 24, windows of 24 with their own RoPE base, linear-scaled global RoPE
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
        shape = {**TINY, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 32, "pad_token_id": 0}
        return hf_model("gemma3", 8642, **shape, rope_parameters=rope, sliding_window=24, query_pre_attn_scalar=24,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])  # fmt: skip
    # gemma2: attention and final soft-caps (low enough to bind), alternating windows of 20, GQA 2:1,
    # head_dim 16
    shape = {**TINY, "head_dim": 16, "pad_token_id": 0}
    return hf_model("gemma2", 1470, **shape, rope_theta=10000.0, sliding_window=20, query_pre_attn_scalar=16,
                    attn_logit_softcapping=5.0, final_logit_softcapping=20.0)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> ModelCase:
    return _tiny_case(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> ModelCase:
    return _tiny_case(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> ModelCase:
    return _tiny_case(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory) -> ModelCase:
    return _tiny_case(tmp_path_factory, "phi3")


@pytest.fixture(scope="session")
def tiny_mistral_window(tmp_path_factory) -> ModelCase:
    return _tiny_case(tmp_path_factory, "mistral-window")


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory) -> ModelCase:
    return _tiny_case(tmp_path_factory, "gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> ModelCase:
    return _tiny_case(tmp_path_factory, "gemma3")


# SmolLM2's cases run 5-35 s each here, so they are in the slow tier; the tiny models keep every
# exactness check in the fast one.
TINY_CASES = [
    "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-mistral-window", "tiny-gemma2", "tiny-gemma3",
]  # fmt: skip


@pytest.fixture(params=[pytest.param("smollm2", marks=pytest.mark.slow), *TINY_CASES])
def model_case(request) -> ModelCase:
    name = "smollm_case" if request.param == "smollm2" else request.param.replace("-", "_")
    return request.getfixturevalue(name)


@pytest.fixture
def make_llm():
    """Build LLMs over preloaded models; on teardown each must be idle, intact and fully freed."""
    built: list[LLM] = []

    def factory(loaded: LoadedModel, **options) -> LLM:
        options.setdefault("dtype", "float32")
        options.setdefault("kv_cache_memory", "64MiB")
        options.setdefault("max_model_len", 512)
        llm = LLM(loaded_model=loaded, **options)
        built.append(llm)
        return llm

    yield factory
    for llm in built:
        engine = llm.engine
        assert not engine.has_unfinished(), "a test left requests in the engine"
        engine.core.check_integrity()
        assert engine.core.pool.num_free == engine.core.kv.num_usable_blocks, "blocks leaked"


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: transformers' own forward with its own KV cache, argmax at each step.
    Returns the tokens and the float32 logits that chose each one."""
    # transformers 5 renamed past_key_values to cache. A PEFT model's forward takes **kwargs and
    # hands them to its base model, so the base model's signature decides (else: a FutureWarning).
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    tokens, logits = [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for step in range(steps):
            row = out.logits[0, -1].float()
            logits.append(row)
            tokens.append(int(row.argmax()))
            if step + 1 < steps:
                cache = {cache_arg: getattr(out, cache_arg)}
                out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **cache)
    return tokens, logits


def hf_next_tokens(
    model: torch.nn.Module, prompt: list[int], tokens: list[int]
) -> tuple[list[int], list[torch.Tensor]]:
    """The reference, teacher-forced: transformers' argmax (and float32 logits) after the prompt and
    after each prefix of `tokens`, from one forward pass over prompt + tokens[:-1]. By induction
    over positions it equals `tokens` exactly when `tokens` is HF's own greedy continuation, at a
    small share of the cost of hf_greedy's step-by-step decoding."""
    with torch.no_grad():
        ids = torch.tensor([prompt + tokens[:-1]])
        rows = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 :].float()
    return rows.argmax(-1).tolist(), list(rows)


def assert_near_reference(reference: torch.nn.Module, prompt: list[int], tokens: list[int], max_move: float):
    """Each of the engine's greedy `tokens` is the reference's argmax after the same prefix
    (teacher-forced), or a token whose reference logit is within 2 x max_move of the top one: a
    swap that a logit move of at most max_move (what the engine's arithmetic is measured to allow)
    can explain. Positions after a swap are still checked, on the engine's own prefix."""
    want, logits = hf_next_tokens(reference, prompt, tokens)
    for i, (got, top) in enumerate(zip(tokens, want, strict=True)):
        gap = float(logits[i][top] - logits[i][got])
        assert gap < 2 * max_move, f"position {i}: token {got} is {gap:.2f} below the reference's {top}"


def assert_rows_alone(kernels, linear, x: torch.Tensor) -> None:
    """A batch-invariant linear's contract: each row of `linear(x)` is the same bits alone, first
    among 7 others, first of up to 128, in chunks of every size from 1 to 25 (every tile height and
    its tails), and on one of `kernels`' threads against all of them."""
    whole = linear(x)
    for row in sorted({0, 5, 77, 127, len(x) - 1} & set(range(len(x)))):
        assert torch.equal(linear(x[row : row + 1])[0], whole[row])
        assert torch.equal(linear(torch.cat([x[row : row + 1], x[:7]]))[0], whole[row])
        assert torch.equal(linear(x[row : row + 128])[0], whole[row])
    for size in range(1, 26):
        assert torch.equal(torch.cat([linear(part) for part in x.split(size)]), whole), size
    threads = kernels.threads
    try:
        kernels._lib.kvharbor_set_threads(1)
        assert torch.equal(linear(x), whole)
    finally:
        kernels._lib.kvharbor_set_threads(threads)


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm) -> Path:
    """A folder with a random-weight tiny Llama that speaks SmolLM2's tokenizer and chat template,
    served as model "tiny-chat": for server tests where SmolLM2's weights are not the point."""
    from servers import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat") / "tiny-chat", smollm.tokenizer)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One real redis-server for the session; tests that share it flush their own keys."""
    from servers import RedisProcess

    with RedisProcess(tmp_path_factory.mktemp("redis-session")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """One real Redis Cluster for the session: 3 masters on loopback ports, from the same
    redis-server binary as `redis_server` (launch/embedded_redis.py). Tests flush it first."""
    from kvharbor.launch.embedded_redis import EmbeddedRedisCluster

    with EmbeddedRedisCluster(3, tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(params=[pytest.param(kind, marks=pytest.mark.slow) for kind in ("single", "cluster")])
def any_redis(request):
    """The same test on one redis-server and on the 3-master Redis Cluster, flushed: `.url`
    picks the client (common/redis_client.py), `.flush()`, and for the cluster `.kill(i)`."""
    server = request.getfixturevalue("redis_server" if request.param == "single" else "redis_cluster")
    server.flush()
    return server
