"""/v1/embeddings through the gateway's app (in-process, fake engines behind httpx.MockTransport):
only engines that serve embeddings get them, under the tenant's identity and as token ids; the
tenant's model grants and TPM hold; a model without embedding engines is a 404 saying what to do."""

from __future__ import annotations

import asyncio
import base64
import json
import struct

import httpx
import openai
import pytest
from gateway_state import gateway_state, polled_pool

from kvharbor.common.load_report import LoadReport
from kvharbor.gateway.app import build_app
from kvharbor.gateway.tenants import hash_key

TENANTS = {"tenants": [
    {"name": "acme", "api_keys": [hash_key("sk-acme")]},
    {"name": "metered", "api_keys": [hash_key("sk-metered")], "limits": {"tpm": 60}},
    {"name": "chat-only", "api_keys": [hash_key("sk-chat")], "models": ["gen"]},
]}  # fmt: skip


class Engines:
    """http://e serves embeddings of "emb", http://g generates "gen"; both record what they got."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.got.append((request.url.host, body))
        vectors = [[1.0, 0.0, float(len(ids))] for ids in body["input"]]
        data = [{"object": "embedding", "index": k, "embedding": base64.b64encode(struct.pack("<3f", *v)).decode()}
                for k, v in enumerate(vectors)]  # fmt: skip
        tokens = sum(map(len, body["input"]))
        return httpx.Response(200, json={"object": "list", "data": data, "model": body["model"],
                                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


def gateway(engines: Engines):
    http = httpx.AsyncClient(transport=httpx.MockTransport(engines))
    pool = polled_pool(http, "emb", ["http://e"], lambda url: {"task": "embed"})
    pool.set_engines("gen", ["http://g"])
    (generating,) = pool.all("gen")
    generating.load, generating.instance_id, generating.polled = LoadReport(model="gen", instance_id="G"), "G", True
    state = gateway_state(http, pool, {"emb": None, "gen": None}, TENANTS)
    return httpx.ASGITransport(app=build_app(state))


def sdk(transport, key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=transport, base_url="http://gw")
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=http, max_retries=0)


def test_embeddings_go_to_embedding_engines_as_token_ids_under_the_tenant():
    engines = Engines()
    transport = gateway(engines)

    async def main():
        return await sdk(transport, "sk-acme").embeddings.create(model="emb", input=[[5, 6, 7], [8, 9]])

    answer = asyncio.run(main())
    assert [d.embedding for d in answer.data] == [[1.0, 0.0, 3.0], [1.0, 0.0, 2.0]]
    ((host, body),) = engines.got
    assert host == "e" and body["input"] == [[5, 6, 7], [8, 9]] and body["user"] == "acme"
    assert body["cache_salt"] and body["encoding_format"] == "base64"


def test_grants_tpm_and_a_model_without_embedding_engines():
    engines = Engines()
    transport = gateway(engines)

    async def main():
        outcomes = {}
        for name, key, model, tokens in (("no-engine", "sk-acme", "gen", 3), ("not-granted", "sk-chat", "emb", 3),
                                         ("first", "sk-metered", "emb", 50), ("second", "sk-metered", "emb", 50)):
            try:
                await sdk(transport, key).embeddings.create(model=model, input=[list(range(1, tokens + 1))])
                outcomes[name] = 200
            except openai.APIStatusError as exc:
                outcomes[name] = (exc.status_code, exc.body.get("code"), exc.body.get("message"))
        return outcomes

    out = asyncio.run(main())
    assert out["no-engine"][:2] == (404, "no_embedding_engine") and "--embedding-model" in out["no-engine"][2]
    assert out["not-granted"][0] == 403
    assert out["first"] == 200 and out["second"][:2] == (429, "rate_limit_tpm")
    assert [host for host, _ in engines.got] == ["e"]  # only the one admitted call reached an engine


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [[2**31]]}, "input"),
        ({"input": ["x"] * 65}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "model": "lora-nope"}, "model"),
    ],
)
def test_bad_embedding_input_is_a_4xx_naming_its_field(body, param):
    engines = Engines()
    transport = gateway(engines)

    async def main():
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            return await http.post("/v1/embeddings", json={"model": "emb", **body},
                                   headers={"Authorization": "Bearer sk-acme"})  # fmt: skip

    reply = asyncio.run(main())
    assert 400 <= reply.status_code < 500, reply.text
    assert str(reply.json()["error"]["param"]).split(".")[0] == param, reply.json()
    assert engines.got == []
