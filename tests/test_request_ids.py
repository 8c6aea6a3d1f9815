"""Request ids: one rule at every HTTP edge (common/openai_api.request_id), and the ids the gateway
gives engines stay within the engines' own limit, migrations included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvharbor.common.openai_api import MAX_REQUEST_ID, APIError, CompletionRequest, request_id
from kvharbor.gateway.call import Call
from kvharbor.gateway.engine_body import continued_payload
from kvharbor.gateway.engine_kinds import KVHARBOR


def test_the_body_wins_then_the_header_then_a_fresh_id():
    assert request_id("body-id", "header-id", "gw") == "body-id"
    assert request_id(None, "header-id", "gw") == "header-id"
    fresh = request_id(None, None, "cmpl")
    assert fresh.startswith("cmpl-") and fresh != request_id(None, None, "cmpl")


@pytest.mark.parametrize("bad", ["new\nline", "caf\u00e9", "x" * (MAX_REQUEST_ID + 1), "tab\there"])
def test_an_id_that_cannot_go_back_as_a_header_is_refused(bad):
    for given, header in ((bad, None), (None, bad)):
        with pytest.raises(APIError) as err:
            request_id(given, header, "gw")
        assert err.value.status == 400 and err.value.param == "request_id"


def test_the_longest_client_id_still_fits_the_engine_after_the_gateway_s_suffixes():
    rid = "r" * MAX_REQUEST_ID
    call = Call("completion", None, None, None, {}, [[1, 2]], rid, None)
    assert call.engine_rid.startswith("r" * 200) and call.engine_rid != Call(
        "completion", None, None, None, {}, [[1]], rid, None
    ).engine_rid  # unique per admission
    body = continued_payload({"model": "m"}, call, [3], None, 99)  # a migration's id is the longest
    assert len(body["request_id"]) <= MAX_REQUEST_ID
    CompletionRequest.model_validate({**body, "prompt": "x"})  # what the engine validates it against
    short = Call("completion", None, None, None, {}, [[1]], "abc", None)
    assert short.engine_rid.startswith("abc.")


def test_the_engine_body_carries_the_engine_id_not_the_clients():
    from kvharbor.gateway.engine_body import engine_body

    call = Call("completion", SimpleNamespace(cache_salt="tenant:t", priority=0, name="t"), None,
                SimpleNamespace(stream=False), {"request_id": "client"}, [[1]], "client", None)  # fmt: skip
    route = SimpleNamespace(kv_prefix_source=lambda engine: None)
    assert engine_body(call, route, SimpleNamespace(kind=KVHARBOR), migratable=False)["request_id"] == call.engine_rid
