"""A reasoning model served: a random-weight tiny Qwen3 (its family's reasoning parser applies)
whose output is held to a think block and an answer by a regex, through the engine server and a
gateway in front of it. The answer carries `reasoning` apart from `content`, whole and streamed."""

from __future__ import annotations

import re

import openai
import pytest
from servers import EngineServerProcess, GatewayProcess, make_tiny_chat_model, start_together, write_tenants

pytestmark = pytest.mark.slow  # an engine and a gateway process

MODEL = "tiny-qwen3-chat"
THINK = r"<think>[a-z]{2,8}</think>[A-Z][a-z]{1,6}\."
ASK = [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm):
    tmp = tmp_path_factory.mktemp("reasoning")
    model = make_tiny_chat_model(tmp / MODEL, smollm.tokenizer, kind="qwen3", head_dim=16)
    write_tenants(tmp / "tenants.yaml", [{"name": "acme", "key": "sk-acme"}])
    engine = EngineServerProcess(tmp, "--model", str(model), "--num-kv-blocks", "64", "--dtype", "float32")
    gateway = GatewayProcess(tmp, "--engines", engine.url, "--model", str(model), "--tenants-file",
                             str(tmp / "tenants.yaml"))  # fmt: skip
    try:
        start_together([engine])
        gateway.start()
        yield engine, gateway
    finally:
        gateway.stop()
        engine.stop()


def chat(url: str, **kw):
    llm = openai.OpenAI(base_url=url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
    return llm.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0,
                                       extra_body={"structured_outputs": {"regex": THINK}}, **kw)  # fmt: skip


@pytest.mark.parametrize("where", ["engine", "gateway"])
def test_the_think_block_is_the_answers_reasoning_whole_and_streamed(served, where):
    url = served[0].url if where == "engine" else served[1].url
    whole = chat(url).choices[0].message
    reasoning = whole.model_extra["reasoning"]
    assert re.fullmatch(r"[a-z]{2,8}", reasoning) and re.fullmatch(r"[A-Z][a-z]{1,6}\.", whole.content)
    thought, answer = "", ""
    for chunk in chat(url, stream=True):
        for choice in chunk.choices:
            thought += (choice.delta.model_extra or {}).get("reasoning") or ""
            answer += choice.delta.content or ""
    assert (thought, answer) == (reasoning, whole.content)  # greedy: the same answer, split the same way


def test_an_earlier_turns_reasoning_is_accepted_under_either_name(served):
    llm = openai.OpenAI(base_url=served[1].url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)
    for name in ("reasoning", "reasoning_content"):
        history = [*ASK, {"role": "assistant", "content": "Paris.", name: "easy"}, {"role": "user", "content": "Why?"}]
        answer = llm.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
