"""Per-tenant caps on one request (max_tokens, n, prompt tokens, body bytes): parsed from the
tenants file and from a Tenant resource, enforced by the gateway with a 400 that names the cap.
The gateway runs in-process before fake engines (the harness of tests/test_gateway_lora.py)."""

from __future__ import annotations

import base64

import pytest
import test_gateway_lora as harness

from kvharbor.common.api_keys import hash_key
from kvharbor.gateway.tenants import Caps, TenantsError, over_cap, parse_tenants
from kvharbor.operator.tenants import TenantError, gateway_tenant

ORIGINAL = harness.TENANTS  # before any test swaps in the capped ones
CAPS = {"max_tokens": 64, "n": 2, "prompt_tokens": 50, "body_bytes": 4000}  # the harness prompt: 40 tokens


def capped_tenants() -> dict:
    return {"tenants": [*ORIGINAL["tenants"], {"name": "capped", "api_keys": [hash_key("sk-capped")],
                                                       "caps": CAPS}]}  # fmt: skip


def test_caps_parse_and_bad_ones_say_which():
    (tenant,) = [t for t in parse_tenants(capped_tenants()).values() if t.name == "capped"]
    assert tenant.caps == Caps(64, 2, 50, 4000)
    assert next(iter(parse_tenants(ORIGINAL).values())).caps == Caps()  # none by default
    for caps, match in (({"max_tokens": 0}, "caps.max_tokens must be a positive integer"),
                        ({"tokens": 5}, "caps takes max_tokens, n, prompt_tokens, body_bytes"),
                        ({"n": True}, "caps.n must be")):  # fmt: skip
        with pytest.raises(TenantsError, match=match):
            parse_tenants({"tenants": [{"name": "x", "api_keys": [hash_key("k")], "caps": caps}]})


@pytest.mark.parametrize(
    ("asked", "param", "words"),
    [
        ({"max_tokens": 65}, "max_tokens", "caps.max_tokens"),
        ({"n": 3}, "n", "caps.n"),
        ({"prompt_tokens": 51}, "messages", "caps.prompt_tokens"),
        ({"body_bytes": 4001}, None, "caps.body_bytes"),
    ],
)
def test_each_cap_has_its_own_message(asked, param, words):
    message, where = over_cap(Caps(**CAPS), asked)
    assert where == param and words in message and str(next(iter(asked.values()))) in message
    assert over_cap(Caps(**CAPS), dict.fromkeys(asked, 1)) is None
    assert over_cap(Caps(), asked) is None  # no cap, no refusal


def run(monkeypatch, **extra):
    monkeypatch.setattr(harness, "TENANTS", capped_tenants())

    async def session(client, fake, index):
        resp = await harness.complete(client, "sk-capped", harness.BASE, **extra)
        return resp, [body for _, body in fake.calls]

    return harness.run_app(session)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 65}, "max_tokens"),
        ({"n": 3}, "n"),
        ({"prompt_token_ids": list(range(1, 52))}, "messages"),
        ({"user": "x" * 5000}, None),  # the body itself is over 4,000 bytes
    ],
)
def test_the_gateway_refuses_what_is_over_a_cap_before_any_engine_sees_it(monkeypatch, extra, param):
    resp, sent = run(monkeypatch, **extra)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "tenant_cap" and error["param"] == param and "over this tenant's cap" in error["message"]
    assert sent == []


def test_within_the_caps_it_serves_and_an_unbounded_max_tokens_is_bounded_by_the_cap(monkeypatch):
    resp, sent = run(monkeypatch, max_tokens=64, n=2)
    assert resp.status_code == 200, resp.text
    assert sent[0]["max_tokens"] == 64 and sent[0]["n"] == 2
    monkeypatch.setattr(harness, "TENANTS", capped_tenants())

    async def chat(client, fake, index):  # chat's max_tokens defaults to unbounded
        body = {"model": harness.BASE, "messages": [{"role": "user", "content": "hi"}], "prompt_token_ids": [1, 2]}
        resp = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-capped"}, json=body)
        return resp, [b for _, b in fake.calls]

    resp, sent = harness.run_app(chat)
    assert resp.status_code == 200, resp.text
    assert sent[0]["max_tokens"] == 64


def test_a_tenant_resources_caps_reach_its_gateway_entry():
    secret = {"metadata": {"name": "k"}, "data": {"api-key": base64.b64encode(b"sk-1").decode()}}

    def tenant(**spec) -> dict:
        return {"metadata": {"name": "t"}, "spec": {"apiKeySecretRef": {"name": "k"}, **spec}}

    entry = gateway_tenant(tenant(caps={"maxTokens": 4096, "n": 4, "promptTokens": 8000, "bodyBytes": 10**6}), secret)
    assert entry["caps"] == {"body_bytes": 10**6, "max_tokens": 4096, "n": 4, "prompt_tokens": 8000}
    parse_tenants({"tenants": [entry]})  # the gateway reads what the operator writes
    assert "caps" not in gateway_tenant(tenant(), secret)  # none: the file is as before
    with pytest.raises(TenantError, match=r"spec\.caps takes"):
        gateway_tenant(tenant(caps={"maxTokenz": 1}), secret)
