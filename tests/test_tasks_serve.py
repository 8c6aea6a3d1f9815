"""Each task and family parser served, behind one real gateway (issue 48):

- embeddings: a real engine on a random-weight Qwen3 embedding model (SmolLM2's tokenizer), driven
  by the `openai` SDK's `embeddings.create` (base64, its default, and float), against transformers
  on the same weights;
- reasoning: a real engine on a random-weight tiny Qwen3 chat model (its family's reasoning parser
  applies) whose output a regex holds to a think block and an answer: `reasoning` apart from
  `content`, whole and streamed, at the engine and through the gateway."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import yaml
from servers import EngineServerProcess, GatewayProcess, make_tiny_chat_model, start_together, write_tenants
from tiny_models import tiny_embedding_model

pytestmark = pytest.mark.slow  # two engines and a gateway

EMBED, CHAT = "tiny-embed", "tiny-qwen3-chat"
THINK = r"<think>[a-z]{2,8}</think>[A-Z][a-z]{1,6}\."
ASK = [{"role": "user", "content": "Capital of France?"}]
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "short"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm):
    tmp = tmp_path_factory.mktemp("embed-serve")
    reference = tiny_embedding_model(tmp / EMBED, "last", smollm.tokenizer)
    chat_model = make_tiny_chat_model(tmp / CHAT, smollm.tokenizer, kind="qwen3", head_dim=16)
    write_tenants(tmp / "tenants.yaml", [{"name": "acme", "key": "sk-acme"}])
    common = ("--num-kv-blocks", "64", "--dtype", "float32")
    embed = EngineServerProcess(tmp, "--model", str(tmp / EMBED), *common)
    chat = EngineServerProcess(tmp, "--model", str(chat_model), *common)
    models = {"models": [{"name": EMBED, "files": str(tmp / EMBED), "engines": [embed.url]},
                         {"name": CHAT, "files": str(chat_model), "engines": [chat.url]}]}  # fmt: skip
    (tmp / "models.yaml").write_text(yaml.safe_dump(models))
    files = ("--models-file", str(tmp / "models.yaml"), "--tenants-file", str(tmp / "tenants.yaml"))
    gateway = GatewayProcess(tmp, *files)
    try:
        start_together([embed, chat])
        gateway.start()
        yield {"reference": reference, "embed": embed, "chat": chat, "gateway": gateway, "tokenizer": smollm.tokenizer}
    finally:
        gateway.stop()
        chat.stop()
        embed.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)


def reference_vector(stack, text: str) -> torch.Tensor:
    ids = stack["tokenizer"].encode(text)
    with torch.no_grad():
        return F.normalize(stack["reference"](torch.tensor([ids])).last_hidden_state[0, -1], dim=0)


def test_the_sdk_gets_transformers_vectors_through_the_gateway_batched_and_one_by_one(stack):
    sdk = client(stack["gateway"].url)
    batched = sdk.embeddings.create(model=EMBED, input=TEXTS)  # base64 on the wire: the SDK's default
    floats = sdk.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    alone = [sdk.embeddings.create(model=EMBED, input=t).data[0].embedding for t in TEXTS]
    assert [d.index for d in batched.data] == [0, 1, 2]
    assert batched.usage.prompt_tokens == sum(len(stack["tokenizer"].encode(t)) for t in TEXTS)
    for k, text in enumerate(TEXTS):
        ref = reference_vector(stack, text)
        got = torch.tensor(batched.data[k].embedding)
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
        assert torch.allclose(torch.tensor(floats.data[k].embedding), got, atol=1e-6)  # float32 on the wire
        assert alone[k] == batched.data[k].embedding  # batch-invariant: one by one, bit for bit


def test_dimensions_and_token_inputs(stack):
    sdk = client(stack["gateway"].url)
    ids = stack["tokenizer"].encode(TEXTS[0])
    by_ids = sdk.embeddings.create(model=EMBED, input=[ids], dimensions=16, encoding_format="float").data[0].embedding
    whole = sdk.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float").data[0].embedding
    assert len(by_ids) == 16
    assert torch.allclose(torch.tensor(by_ids), F.normalize(torch.tensor(whole[:16]), dim=0), atol=1e-5)
    with pytest.raises(openai.BadRequestError) as too_many:
        sdk.embeddings.create(model=EMBED, input="x", dimensions=65)
    assert too_many.value.body["param"] == "dimensions"


def test_a_model_without_embedding_engines_is_a_404_that_says_how_to_start_one(stack):
    with pytest.raises(openai.NotFoundError) as missing:
        client(stack["gateway"].url).embeddings.create(model=CHAT, input="hello")
    assert missing.value.body["code"] == "no_embedding_engine" and "--embedding-model" in missing.value.body["message"]
    # the engines themselves: each refuses the other task, naming model
    wrong = httpx.post(stack["chat"].url + "/v1/embeddings", json={"model": CHAT, "input": "x"}, timeout=30)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
    generate = httpx.post(stack["embed"].url + "/v1/completions", json={"model": EMBED, "prompt": "hi"}, timeout=30)
    assert generate.status_code == 400 and "serves embeddings" in generate.json()["error"]["message"]


def chat(url: str, **kw):
    llm = openai.OpenAI(base_url=url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
    return llm.chat.completions.create(model=CHAT, messages=ASK, max_tokens=24, temperature=0,
                                       extra_body={"structured_outputs": {"regex": THINK}}, **kw)  # fmt: skip


@pytest.mark.parametrize("where", ["chat", "gateway"])
def test_the_think_block_is_the_answers_reasoning_whole_and_streamed(stack, where):
    url = stack[where].url
    whole = chat(url).choices[0].message
    reasoning = whole.model_extra["reasoning"]
    assert re.fullmatch(r"[a-z]{2,8}", reasoning) and re.fullmatch(r"[A-Z][a-z]{1,6}\.", whole.content)
    thought, answer = "", ""
    for chunk in chat(url, stream=True):
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning") or ""
            answer += choice.delta.content or ""
    assert (thought, answer) == (reasoning, whole.content)  # greedy: the same answer, split the same way


def test_an_earlier_turns_reasoning_is_accepted_under_either_name(stack):
    llm = openai.OpenAI(base_url=stack["gateway"].url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
    for name in ("reasoning", "reasoning_content"):
        history = [*ASK, {"role": "assistant", "content": "Paris.", name: "easy"}, {"role": "user", "content": "Why?"}]
        answer = llm.chat.completions.create(model=CHAT, messages=history, max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
