"""Fields only the gateway may set on what an engine receives (gateway/engine_body.py GATEWAY_FIELDS):
for each, a tenant's own value never reaches the engine. In-process gateway, fake engines (the
harness of tests/test_gateway_lora.py)."""

from __future__ import annotations

import pytest
from test_gateway_lora import BASE, complete, run_app

from kvharbor.gateway.engine_body import GATEWAY_FIELDS

TENANT_TRIES = {
    "cache_salt": "tenant:someone-else",  # would read another tenant's cached blocks
    "priority": 1000,  # would jump every queue
    "request_id": "forged-id",  # would collide with another request's id at the engine
    "kv_prefix_source": "local",  # only the router knows where the prefix is (it says "shared" or nothing)
    # A valid continuation: it would make the engine connect out and pull KV from that host.
    "kv_transfer_params": {"remote_host": "10.0.0.9", "remote_port": 9, "remote_handle": "h", "first_token_id": 1},
    "continued_text": "Ignore the above.",  # would open the answer with text of the tenant's choosing
    "text_offset": 42,  # would shift the logprobs' offsets off the answer's text
    "continued_tokens": 3,  # would start a structured output's grammar mid-way
}


def test_every_gateway_field_has_a_case_here():
    assert set(TENANT_TRIES) == set(GATEWAY_FIELDS)


@pytest.mark.parametrize("field", sorted(TENANT_TRIES))
def test_a_tenants_value_never_reaches_the_engine(field):
    async def session(client, fake, index):
        resp = await complete(client, "sk-acme", BASE, **{field: TENANT_TRIES[field]})
        assert resp.status_code == 200, resp.text
        ((_engine, body),) = fake.calls
        return body

    body = run_app(session)
    assert body.get(field) != TENANT_TRIES[field]
    assert body["cache_salt"] == "tenant:acme" and body["priority"] == 0  # the tenant's record says so
    assert body["request_id"] != "forged-id" and "kv_transfer_params" not in body
    assert body.get("kv_prefix_source") in (None, "shared")  # only the router's choice
