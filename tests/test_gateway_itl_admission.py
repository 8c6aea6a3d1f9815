"""The ITL rule on real processes: while an engine runs a long output, its measured decode step
is over an (unreachably low) ITL target, so a new request does not fit: a sheddable tenant's is
shed at once, another's waits and gets 503 queue_timeout. Once the engine is idle again, it fits."""

from __future__ import annotations

import threading

import httpx
import pytest
from servers import EngineServerProcess, GatewayProcess, wait_for, write_tenants

pytestmark = pytest.mark.slow  # a real engine and gateway

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_chat_model):
    logs = tmp_path_factory.mktemp("itl")
    tenants = logs / "tenants.yaml"
    write_tenants(tenants, [{"name": "acme", "key": "sk-acme"}, {"name": "batch", "key": "sk-batch", "priority": -1}])
    engine = EngineServerProcess(logs, "--model", str(tiny_chat_model), "--dtype", "float32", "--num-kv-blocks", "256",
                                 "--max-model-len", "2048", "--log-level", "warning")  # fmt: skip
    with engine:
        args = ("--engines", engine.url, "--model", str(tiny_chat_model), "--tenants-file", str(tenants),
                "--slo-itl-ms", "0.01", "--queue-timeout", "1", "--load-interval", "0.1")  # fmt: skip
        with GatewayProcess(logs, *args) as gw:
            wait_for(lambda: httpx.get(gw.url + "/ready").status_code == 200, what="gateway sees the engine")
            yield engine, gw


def chat(gw, key: str, max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)  # fmt: skip


def test_a_flood_of_long_output_makes_new_requests_queue_or_shed_by_the_itl_rule(stack):
    engine, gw = stack
    assert chat(gw, "sk-acme", 8).status_code == 200  # an idle engine fits, whatever its step time
    long = threading.Thread(target=chat, args=(gw, "sk-acme", 1500), daemon=True)
    long.start()
    try:
        # The engine measures its decode steps while the long output runs; the gateway polls it.
        wait_for(lambda: (lo := httpx.get(engine.url + "/load").json())["running"] >= 1 and lo["decode_step_ms"] > 0,
                 what="a running, measured decode")  # fmt: skip
        # The gateway sees that report only at its next poll (every 0.1 s): a request sent before
        # then is routed on the idle report and served, so send until one is not (bounded by time).
        shed = wait_for(lambda: (r := chat(gw, "sk-batch", 4)).status_code != 200 and r,
                        timeout=10, what="the gateway's poll of the measured decode")  # fmt: skip
        assert shed.status_code == 503 and shed.json()["error"]["code"] == "shed_slo", shed.text
        queued = chat(gw, "sk-acme", 4)
        assert queued.status_code == 503 and queued.json()["error"]["code"] == "queue_timeout", queued.text
    finally:
        long.join(timeout=120)
    wait_for(lambda: httpx.get(engine.url + "/load").json()["running"] == 0, what="idle again")
    assert chat(gw, "sk-acme", 4).status_code == 200
