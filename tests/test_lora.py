"""Multi-LoRA serving against Hugging Face transformers + peft (float32, the same base and adapter
weights): a tiny random Llama with three random adapters of different ranks and targets, greedy
tokens one request at a time, in a mixed batch (the base and all three in one step), on prefix
hits, in chunked prefill and under preemption; and the adapter files' checks, the slots' LRU
swapping and isolation of the prefix cache between adapters."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import hf_next_tokens
from lora_adapters import make_adapter

from kvharbor.engine import SamplingParams
from kvharbor.engine.lora.adapter import AdapterError, load_adapter
from kvharbor.engine.lora.lora_manager import UnknownAdapter

peft = pytest.importorskip("peft")

STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
# (name, rank, alpha, targets): different ranks, scalings and module sets, one with rsLoRA.
ADAPTERS = [
    ("attn4", 4, 8, ["q_proj", "v_proj"], False),
    ("mlp8", 8, 16, ["gate_proj", "up_proj", "down_proj"], False),
    ("all16", 16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """name -> (folder, peft reference model) for the tiny Llama."""
    out = {}
    for seed, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        out[name] = (str(folder), make_adapter(tiny_llama.hf, folder, rank, alpha, targets, rslora=rslora, seed=seed))
    return out


@pytest.fixture
def lora_llm(make_llm, tiny_llama, adapters):
    def build(**options):
        specs = [f"{name}={folder}" for name, (folder, _) in adapters.items()]
        return make_llm(tiny_llama.loaded, lora=specs, **options)

    return build


def reference_tokens(adapters, tiny_llama, name: str | None, prompt: list[int], ours: list[int]) -> list[int]:
    model = tiny_llama.hf if name is None else adapters[name][1]
    return hf_next_tokens(model, prompt, ours)[0]


def run(llm, prompts, names, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=names)
    return [o.outputs[0].token_ids for o in outs], outs


def test_one_request_at_a_time_matches_peft(lora_llm, tiny_llama, adapters):
    llm = lora_llm()
    prompt = tiny_llama.prompts[3]
    base = run(llm, [prompt], [None])[0][0]
    for name in adapters:
        ours = run(llm, [prompt], [name])[0][0]
        assert ours == reference_tokens(adapters, tiny_llama, name, prompt, ours), name
        assert ours != base, f"{name} left the base model's tokens unchanged: is its delta applied?"


def test_a_mixed_batch_of_the_base_and_three_adapters_matches(lora_llm, tiny_llama, adapters):
    llm = lora_llm(max_loras=3)
    names = [None, "attn4", "mlp8", "all16"] * 2
    prompts = tiny_llama.prompts
    ours, _ = run(llm, prompts, names)
    for prompt, name, tokens in zip(prompts, names, ours, strict=True):
        assert tokens == reference_tokens(adapters, tiny_llama, name, prompt, tokens), name


def test_prefix_hits_stay_within_one_adapter(lora_llm, tiny_llama, adapters):
    llm = lora_llm()
    prompt = tiny_llama.shared_prompts[0]
    _, first = run(llm, [prompt], ["attn4"])
    ours, again = run(llm, [prompt], ["attn4"])
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens >= 16  # a hit under the same adapter
    assert ours[0] == reference_tokens(adapters, tiny_llama, "attn4", prompt, ours[0])
    for other in ("mlp8", None):  # never under another adapter, nor the base
        _, out = run(llm, [prompt], [other])
        assert out[0].num_cached_tokens == 0, other


def test_chunked_prefill_and_preemption_match(lora_llm, tiny_llama, adapters):
    # A 32-token step budget cuts the longer prompts into chunks; a 9-block pool (144 tokens) holds
    # the longest request (112 tokens) but not 8 of 17-112 tokens, so requests are preempted.
    llm = lora_llm(max_num_batched_tokens=32, num_kv_blocks=9, kv_cache_memory=None, max_model_len=144)
    names = ["all16", "attn4", None, "mlp8"] * 2
    ours, _ = run(llm, tiny_llama.prompts, names)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for prompt, name, tokens in zip(tiny_llama.prompts, names, ours, strict=True):
        assert tokens == reference_tokens(adapters, tiny_llama, name, prompt, tokens), name


def test_adapters_beyond_max_loras_swap_in_lru_order(lora_llm, tiny_llama, adapters):
    llm = lora_llm(max_loras=1)
    manager = llm.engine.core.loras
    names = ["attn4", "mlp8", "all16", "attn4"]
    ours, _ = run(llm, tiny_llama.prompts[:4], names)
    for prompt, name, tokens in zip(tiny_llama.prompts[:4], names, ours, strict=True):
        assert tokens == reference_tokens(adapters, tiny_llama, name, prompt, tokens), name
    assert manager.swaps >= 3 and len(manager.active) == 1
    llm2 = lora_llm(max_loras=2)
    m2 = llm2.engine.core.loras
    for name in ("attn4", "mlp8", "attn4", "all16"):  # mlp8 is the least recently used when all16 comes
        run(llm2, [tiny_llama.prompts[0]], [name])
    assert set(m2.active) == {"attn4", "all16"}


def test_unknown_adapters_and_lora_off_are_refused(lora_llm, make_llm, tiny_llama):
    llm = lora_llm()
    with pytest.raises(UnknownAdapter, match="not loaded on this engine"):
        llm.generate([tiny_llama.prompts[0]], GREEDY, lora="nope")
    plain = make_llm(tiny_llama.loaded)
    with pytest.raises(UnknownAdapter, match="serves no LoRA"):
        plain.generate([tiny_llama.prompts[0]], GREEDY, lora="attn4")


def test_load_unload_and_the_load_report(make_llm, tiny_llama, adapters):
    llm = make_llm(tiny_llama.loaded, enable_lora=True, max_loras=2, max_cpu_loras=2)
    folder = adapters["attn4"][0]
    assert llm.engine.core.load().lora_adapters == {} and llm.engine.core.load().lora_slots == 2
    llm.load_lora("a", folder)
    with pytest.raises(AdapterError, match="already loaded"):
        llm.load_lora("a", folder)
    llm.load_lora("b", adapters["mlp8"][0])
    with pytest.raises(AdapterError, match="max-cpu-loras"):
        llm.load_lora("c", adapters["all16"][0])
    run(llm, [tiny_llama.prompts[0]], ["a"])
    report = llm.engine.core.load()
    assert report.lora_active == ("a",) and set(report.lora_adapters) == {"a", "b"}
    assert report.lora_adapters["a"].startswith("a@") and report.lora_bytes > 0
    llm.unload_lora("a")
    assert "a" not in llm.engine.core.load().lora_adapters and llm.engine.core.load().lora_active == ()
    with pytest.raises(UnknownAdapter):
        llm.unload_lora("a")


def test_a_request_in_flight_keeps_its_adapter_loaded(make_llm, tiny_llama, adapters):
    llm = make_llm(tiny_llama.loaded, lora=[f"a={adapters['attn4'][0]}"])
    llm.engine.add_request("r", None, GREEDY, prompt_token_ids=tiny_llama.prompts[0], lora="a")
    llm.engine.step()
    with pytest.raises(AdapterError, match="in flight"):
        llm.unload_lora("a")
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.unload_lora("a")


def test_same_weights_under_another_name_or_reloaded_differently_get_other_kv(tiny_llama, adapters, tmp_path):
    arch = tiny_llama.loaded.arch
    folder = adapters["attn4"][0]
    a, b = load_adapter("a", folder, arch, 16), load_adapter("b", folder, arch, 16)
    assert a.digest == b.digest and a.identity != b.identity
    changed = tmp_path / "changed"
    make_adapter(tiny_llama.hf, changed, 4, 8, ["q_proj", "v_proj"], seed=99)
    assert load_adapter("a", changed, arch, 16).identity != a.identity


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
        (lambda d: (d / "adapter_model.safetensors").write_bytes(b"junk"), "not a valid safetensors"),
        (lambda d: _config(d, use_dora=True), "DoRA is not supported"),
        (lambda d: _config(d, bias="all"), "bias='all'"),
        (lambda d: _config(d, r=32), "rank 32, above --max-lora-rank 16"),
        (lambda d: _config(d, r=2), "expected"),
        (lambda d: _config(d, peft_type="PREFIX_TUNING"), "only LORA"),
        (lambda d: (d / "adapter_config.json").write_text("{"), "cannot be read as JSON"),
    ],
)
def test_bad_adapter_folders_are_refused_naming_the_fix(tiny_llama, adapters, tmp_path, edit, match):
    import shutil

    folder = tmp_path / "adapter"
    shutil.copytree(adapters["attn4"][0], folder)
    edit(folder)
    with pytest.raises(AdapterError, match=match):
        load_adapter("x", folder, tiny_llama.loaded.arch, 16)


def test_an_adapter_for_another_model_is_refused(tiny_llama, adapters):
    wider = dataclasses.replace(tiny_llama.loaded.arch, intermediate_size=256)
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter("x", adapters["all16"][0], wider, 16)
    shallower = dataclasses.replace(tiny_llama.loaded.arch, num_layers=2)
    with pytest.raises(AdapterError, match="is it for this model"):
        load_adapter("x", adapters["all16"][0], shallower, 16)


def test_bad_names_and_a_missing_folder(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="adapter name"):
        load_adapter("bad name", tmp_path, tiny_llama.loaded.arch, 16)
    with pytest.raises(AdapterError, match="not a folder"):
        load_adapter("x", tmp_path / "nowhere", tiny_llama.loaded.arch, 16)


def _config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_a_request_waiting_for_a_slot_is_not_starved_by_the_resident_adapter(make_llm, tiny_llama, adapters):
    # One slot: a request on mlp8 arrives while attn4 runs, then more attn4 requests keep coming.
    # They queue behind mlp8's (in arrival order) instead of keeping attn4's slot busy forever.
    llm = make_llm(tiny_llama.loaded, lora=[f"{n}={adapters[n][0]}" for n in ("attn4", "mlp8")], max_loras=1)
    engine, prompt = llm.engine, tiny_llama.prompts[0]
    first_token_step: dict[str, int] = {}
    engine.add_request("a0", None, GREEDY, prompt_token_ids=prompt, lora="attn4")
    engine.add_request("b", None, GREEDY, prompt_token_ids=prompt, lora="mlp8")
    step = 0
    while engine.has_unfinished():
        step += 1
        if step <= 6:  # attn4 keeps arriving while b waits
            engine.add_request(f"a{step}", None, GREEDY, prompt_token_ids=prompt, lora="attn4")
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token_step.setdefault(out.request_id, step)
    assert first_token_step["b"] < first_token_step["a1"] and engine.core.loras.swaps >= 2


def test_only_the_slot_that_frees_first_is_held_for_a_waiting_request(make_llm, tiny_llama, adapters):
    # Two slots: attn4 (1 request) and mlp8 (2). all16 waits; attn4's slot frees first, so a new
    # attn4 request waits behind all16, while a new mlp8 request still runs at once.
    llm = make_llm(tiny_llama.loaded, lora=[f"{n}={folder}" for n, (folder, _) in adapters.items()], max_loras=2)
    engine, prompt = llm.engine, tiny_llama.prompts[0]
    for rid, name in (("a0", "attn4"), ("m0", "mlp8"), ("m1", "mlp8"), ("c", "all16"), ("a1", "attn4"),
                      ("m2", "mlp8")):  # fmt: skip
        long = SamplingParams(max_tokens=3 * STEPS, temperature=0.0, ignore_eos=True)  # mlp8's slot stays busy
        engine.add_request(rid, None, long if name == "mlp8" else GREEDY, prompt_token_ids=prompt, lora=name)
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
    assert first["m2"] == first["m0"] == 1  # the other slot kept taking its adapter's requests
    assert first["c"] < first["a1"]
