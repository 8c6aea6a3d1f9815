"""`kvharbor serve` with SmolLM2 in a real subprocess, driven by the real `openai` client: chat and
completions, streamed and not, n, stop strings, seeds, logprobs, usage, greedy equality with the
offline engine, 16 concurrent streams, client disconnects, and metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time

import httpx
import openai
import pytest
from conftest import hf_greedy
from lora_adapters import make_adapter, write_random_adapter
from servers import EngineServerProcess, metric, wait_for

from kvharbor.common.load_report import LoadReport
from kvharbor.engine import SamplingParams

pytestmark = pytest.mark.slow  # a real `kvharbor serve`

MODEL = "SmolLM2-135M-Instruct"
# float32 so greedy outputs can be compared exactly with the offline engine.
SERVE_ARGS = ("--dtype", "float32", "--num-kv-blocks", "180", "--max-model-len", "1024", "--log-level", "warning")
QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello in Spanish."]


ADAPTER = "smol-lora"


@pytest.fixture(scope="module")
def smol_adapter(smollm_case, tmp_path_factory):
    """A random rank-8 LoRA adapter on SmolLM2 (attention and MLP), with its peft reference."""
    folder = tmp_path_factory.mktemp(ADAPTER)
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    return str(folder), make_adapter(smollm_case.hf, folder, 8, 16, targets, seed=3, scale=0.3)


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_adapter):
    lora = ("--lora", f"{ADAPTER}={smol_adapter[0]}", "--allow-runtime-lora")
    with EngineServerProcess(tmp_path_factory.mktemp("serve"), *SERVE_ARGS, *lora) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(smollm):
    from kvharbor.engine import LLM

    return LLM(loaded_model=smollm, dtype="float32", kv_cache_memory="64MiB", max_model_len=1024)


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_models_lists_the_served_model_and_its_adapters(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ADAPTER]
    assert models.data[1].model_extra["parent"] == MODEL and models.data[0].model_extra["parent"] is None


def test_an_adapter_request_answers_as_peft_does_beside_the_base_model(server, client, smol_adapter, smollm_case):
    tok = smollm_case.loaded.tokenizer
    prompts = ["Once upon a time", "The three primary colors are"]

    def complete(model, prompt):
        return client.completions.create(model=model, prompt=tok.encode(prompt), max_tokens=16, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the base and the adapter in the same steps
        runs = list(pool.map(lambda job: complete(*job), [(m, p) for p in prompts for m in (MODEL, ADAPTER)]))
    for prompt, base, adapted in zip(prompts, runs[::2], runs[1::2], strict=True):
        want = tok.decode(hf_greedy(smol_adapter[1], tok.encode(prompt), 16)[0])
        assert adapted.model == ADAPTER and adapted.choices[0].text == want
        assert base.choices[0].text != want
    again = complete(ADAPTER, prompts[0])
    assert again.choices[0].text == runs[1].choices[0].text
    text = httpx.get(server.admin_url + "/metrics").text
    assert metric(text, "kvharbor_lora_requests_total", f'adapter="{ADAPTER}"') >= 3
    assert metric(text, "kvharbor_lora_adapter_loaded", f'active="true",adapter="{ADAPTER}"') == 1
    assert metric(text, "kvharbor_lora_swaps_total") >= 1


def test_runtime_load_and_unload_of_adapters(server, client, smol_adapter, smollm, tmp_path):
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
    loaded = post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": smol_adapter[0]})
    assert loaded.status_code == 200, loaded.text
    assert "second" in [m.id for m in client.models.list().data]
    assert LoadReport.from_json(httpx.get(server.url + "/load").json()).lora_adapters.keys() == {ADAPTER, "second"}
    reply = client.chat.completions.create(model="second", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.model == "second"
    again = post("/v1/load_lora_adapter", {"lora_name": "second", "lora_path": smol_adapter[0]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    wide = write_random_adapter(tmp_path / "wide", smollm.arch, 32)
    too_wide = post("/v1/load_lora_adapter", {"lora_name": "third", "lora_path": wide})
    assert too_wide.status_code == 400 and "--max-lora-rank 16" in too_wide.json()["error"]["message"]
    assert "third" not in [m.id for m in client.models.list().data]  # nothing half-loaded
    assert post("/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 200
    assert post("/v1/unload_lora_adapter", {"lora_name": "second"}).status_code == 404
    for gone in ("second", "nope"):
        with pytest.raises(openai.NotFoundError, match="not served here"):
            client.chat.completions.create(model=gone, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def test_a_prompt_cached_for_the_base_model_misses_for_an_adapter(server):
    body = {"prompt": "hello world " * 30, "max_tokens": 1, "temperature": 0}
    post = lambda model: httpx.post(server.url + "/v1/completions", json={**body, "model": model}, timeout=60)  # noqa: E731
    cached = lambda r: (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # noqa: E731
    assert cached(post(MODEL)) == 0 and cached(post(MODEL)) > 0
    assert cached(post(ADAPTER)) == 0 and cached(post(ADAPTER)) > 0


def test_the_printed_curl_line_answers_the_question(server):
    (line,) = [line for line in server.log().splitlines() if "try: curl -s " in line]
    body = json.loads(line.split(" -d '", 1)[1].rsplit("'", 1)[0])
    url = line.split("curl -s ", 1)[1].split()[0]
    answer = httpx.post(url, json=body, timeout=120).json()
    assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_a_stop_string_retires_the_request_in_the_engine_core_at_once(client, server):
    """The API server finds the stop string and tells the core, which stops generating: without
    that, the core would go on for the 500 tokens asked for (~25 s here)."""
    resp = chat(client, QUESTIONS[0], temperature=0, max_tokens=500, stop=["Paris"], extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == "The capital of France is " and resp.choices[0].finish_reason == "stop"
    load = wait_for(lambda: (r := httpx.get(server.url + "/load").json())["running"] == 0 and r, timeout=5)
    assert load["kv_blocks_free"] == load["kv_blocks_total"]


def test_chat_unstreamed_with_usage(client):
    resp = chat(client, QUESTIONS[0], temperature=0, max_tokens=20)
    assert resp.choices[0].message.content == "The capital of France is Paris."
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 20
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_streamed_joins_to_the_unstreamed_answer(client):
    stream = chat(
        client, QUESTIONS[0], temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == "The capital of France is Paris."
    assert reasons[-1] == "stop" and usage.completion_tokens == 8


def test_token_ids_returned_and_a_continuation_from_them_ends_the_same(server):
    """return_token_ids (vLLM's): each choice, and each streamed delta, carries its token ids. The
    gateway's stream migration rests on this: the prompt's ids plus the first k generated ones,
    sent again with k fewer max_tokens, end with the same greedy text (gateway/relay.py)."""
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 20, "return_token_ids": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] == 8
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
    assert "token_ids" not in httpx.post(server.url + "/v1/chat/completions", json={**body, "return_token_ids": False},
                                         timeout=60).json()["choices"][0]  # fmt: skip
    prompt = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    k = 3
    rest = {**body, "prompt_token_ids": prompt + ids[:k], "max_tokens": 20 - k}
    cont = httpx.post(server.url + "/v1/chat/completions", json=rest, timeout=60).json()["choices"][0]
    assert ids[:k] + cont["token_ids"] == ids
    done = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids[:k]}).json()["prompt"]
    assert done + cont["message"]["content"] == whole["choices"][0]["message"]["content"]


def test_a_completion_continued_from_its_streamed_text_goes_on_with_the_same_logprob_offsets(server):
    """text_offset (kvharbor's): a migrated completion's continuation, told where its text starts in
    the client's, gives each token the text_offset an unbroken stream would have; 0 is the default."""
    prompt = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "The capital of France is"}).json()
    body = {"model": MODEL, "prompt_token_ids": prompt["tokens"], "temperature": 0, "max_tokens": 10, "logprobs": 0,
            "return_token_ids": True, "stream": True}  # fmt: skip

    def streamed(request: dict) -> tuple[list[int], list[int], str]:
        with httpx.stream("POST", server.url + "/v1/completions", json=request, timeout=60) as r:
            choices = [c for line in r.iter_lines() if line.startswith("data: {")
                       for c in json.loads(line[6:])["choices"]]  # fmt: skip
        offsets = [o for c in choices if c.get("logprobs") for o in c["logprobs"]["text_offset"]]
        return [t for c in choices for t in c.get("token_ids", [])], offsets, "".join(c["text"] for c in choices)

    ids, offsets, text = streamed(body)
    assert len(ids) == len(offsets) == 10 and offsets[0] == 0
    k = 4
    done = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids[:k]}).json()["prompt"]
    assert text.startswith(done)
    rest = {**body, "prompt_token_ids": prompt["tokens"] + ids[:k], "max_tokens": 10 - k, "text_offset": len(done)}
    cont_ids, cont_offsets, _ = streamed(rest)
    assert cont_ids == ids[k:] and cont_offsets == offsets[k:]
    whole = httpx.post(server.url + "/v1/completions", json={**rest, "stream": False}, timeout=60).json()
    assert whole["choices"][0]["logprobs"]["text_offset"] == offsets[k:]
    bad = httpx.post(server.url + "/v1/completions", json={**rest, "text_offset": -1}, timeout=60)
    assert bad.status_code == 400 and "text_offset" in bad.text


def test_completions_streamed_and_not(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8


def test_greedy_outputs_equal_the_offline_engine(client, offline):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [o.outputs[0].text for o in offline.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:  # batched, as the offline engine ran them
        answers = pool.map(lambda q: chat(client, q, temperature=0, max_tokens=24), QUESTIONS)
        got = [a.choices[0].message.content for a in answers]
    assert got == expected
    prompts = ["Once upon a time", "def add(a, b):"]
    expected = [o.outputs[0].text for o in offline.generate(prompts, params)]
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected


def test_n_samples_and_seed_reproducibility(client):
    a = chat(client, "Tell me a story.", n=2, temperature=1.0, seed=11, max_tokens=12)
    b = chat(client, "Tell me a story.", n=2, temperature=1.0, seed=11, max_tokens=12)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    assert 2 <= a.usage.completion_tokens <= 2 * 12  # both samples count


def test_stop_strings(client):
    resp = chat(client, QUESTIONS[0], temperature=0, max_tokens=20, stop=["Paris"])
    assert resp.choices[0].message.content == "The capital of France is "
    assert resp.choices[0].finish_reason == "stop"


def test_logprobs_and_extensions(client):
    resp = chat(
        client,
        QUESTIONS[0],
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "min_tokens": 3, "top_k": 5},
    )
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == ["The", " capital", " of"]
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    comp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0, logprobs=1
    )
    assert len(comp.choices[0].logprobs.tokens) == 2 and len(comp.choices[0].logprobs.top_logprobs[0]) == 1


def test_prompt_token_ids_and_cached_tokens(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hello " * 40}).json()["tokens"]
    assert (
        httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"] == "hello " * 40
    )
    body = {"model": MODEL, "prompt_token_ids": ids, "max_tokens": 2, "temperature": 0}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    second = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens"] == len(ids)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_16_concurrent_streams_complete_and_return_every_block(server, offline):
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = {
        q: o.outputs[0].text
        for q, o in zip(
            QUESTIONS, offline.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params), strict=True
        )
    }

    async def one(aclient, q):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=16, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(16)]
        return questions, await asyncio.gather(*(one(aclient, q) for q in questions))

    questions, answers = asyncio.run(main())
    assert answers == [expected[q] for q in questions]
    load = httpx.get(server.url + "/load").json()
    assert (load["running"], load["waiting"], load["in_flight"]) == (0, 0, 0)
    assert load["kv_blocks_free"] == load["kv_blocks_total"]


def test_a_client_that_disconnects_mid_stream_is_aborted(server):
    before = metric(httpx.get(server.admin_url + "/metrics").text, "kvharbor_requests_aborted_total")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a very long essay."}],
        "max_tokens": 800,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert httpx.get(server.url + "/load").json()["running"] == 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = httpx.get(server.url + "/load").json()
        if load["running"] == 0 and load["in_flight"] == 0:
            break
        time.sleep(0.2)
    assert load["running"] == 0 and load["kv_blocks_free"] == load["kv_blocks_total"]
    after = metric(httpx.get(server.admin_url + "/metrics").text, "kvharbor_requests_aborted_total")
    assert after == before + 1


def test_metrics_report_load_and_latency(server, client):
    chat(client, QUESTIONS[2], temperature=0, max_tokens=4)
    load = httpx.get(server.url + "/load").json()  # the operator's `slo` autoscaling metric
    assert load["slo_requests"] >= 1 and 0.0 <= load["slo_attainment"] <= 1.0
    text = httpx.get(server.admin_url + "/metrics").text
    for name in (
        "kvharbor_requests_running",
        "kvharbor_requests_waiting",
        "kvharbor_kv_blocks_total",
        "kvharbor_kv_blocks_free",
        "kvharbor_kv_blocks_cached",
        "kvharbor_prefix_cache_hit_rate",
    ):
        assert re.search(rf"^{name}{{", text, re.MULTILINE), name
    assert metric(text, "kvharbor_time_to_first_token_seconds_count") >= 1
    assert metric(text, "kvharbor_inter_token_latency_seconds_count") >= 1
    assert metric(text, "kvharbor_e2e_request_latency_seconds_count") >= 1
    assert metric(text, "kvharbor_request_prompt_tokens_count") >= 1
    assert re.search(
        r'^kvharbor_requests_total{endpoint="/v1/chat/completions",status="200"} [1-9]', text, re.MULTILINE
    )


def test_health_ready_and_load(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json()["ready"] is True
    load = httpx.get(server.url + "/load").json()
    for key in (
        "running",
        "waiting",
        "waiting_prefill_tokens",
        "kv_blocks_total",
        "kv_blocks_free",
        "kv_blocks_cached",
        "prefill_tokens_per_s",
        "decode_step_ms",
        "instance_id",
        "model",
    ):
        assert key in load, key
    assert load["model"] == MODEL
    report = LoadReport.from_json(load)  # what the gateway and the operator read
    assert report.model == MODEL and report.instance_id and report.kv_blocks_total == 180 and not report.draining
