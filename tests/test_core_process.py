"""`kvharbor serve` runs its engine core in a process of its own: the death of either side is
loud, and a clean stop stops both (the stop string told to the core: tests/test_server.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from servers import EngineServerProcess, wait_for

pytestmark = pytest.mark.slow  # real `kvharbor serve` processes

ARGS = ("--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "1024", "--log-level", "info")


def core_pid(server: EngineServerProcess) -> int:
    kids = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    (pid,) = [int(k) for k in kids if b"core_process" in Path(f"/proc/{k}/cmdline").read_bytes()]
    return pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture
def server(tmp_path, tiny_chat_model):
    with EngineServerProcess(tmp_path, "--model", str(tiny_chat_model), *ARGS) as proc:
        yield proc


def test_the_death_of_the_core_makes_the_server_say_503(server):
    body = {"model": "tiny-chat", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        os.kill(core_pid(server), signal.SIGKILL)
        rest = list(lines)  # the open stream ends, with an error event, instead of hanging
    assert any('"error"' in line for line in rest)
    assert httpx.get(server.url + "/ready").status_code == 503
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    refused = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2})
    assert refused.status_code == 503 and "engine core" in refused.json()["error"]["message"]
    assert server.proc.poll() is None  # the API server stays up to say so


def test_the_death_of_the_server_stops_the_core(server):
    pid = core_pid(server)
    server.proc.kill()
    server.proc.wait(10)
    wait_for(lambda: not alive(pid), timeout=30, what="the core process to exit")


def test_sigterm_stops_both_and_the_core_exits_first(server):
    pid = core_pid(server)
    server.signal(signal.SIGTERM)
    assert server.wait(60) == 0
    assert not alive(pid)
    assert "engine core stopped" in server.log()


def test_an_engines_queue_is_bounded_with_a_429_naming_the_limit(tmp_path, tiny_chat_model):
    """Issue 47, item 5: the engine's waiting queue had no cap. With its core stopped, requests
    wait for their first token; past --max-waiting-requests the next gets 429 at once, naming the
    limit, and the queued ones finish once the core runs again."""
    import asyncio
    import concurrent.futures

    args = (*ARGS, "--max-waiting-requests", "3")
    with EngineServerProcess(tmp_path, "--model", str(tiny_chat_model), *args) as server:
        body = {"model": "tiny-chat", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2}

        async def post(extra: dict) -> httpx.Response:
            async with httpx.AsyncClient(timeout=60) as http:
                return await http.post(server.url + "/v1/completions", json={**body, **extra})

        core = core_pid(server)
        os.kill(core, signal.SIGSTOP)
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                queued = pool.submit(asyncio.run, post({}))  # two prompts: two of the three places
                wait_for(lambda: httpx.get(server.url + "/load", timeout=5).json()["in_flight"] == 2, 10, "the queue")
                refused = asyncio.run(post({}))  # two more would make four
                one_more = pool.submit(asyncio.run, post({"prompt": [[5, 6]]}))  # the third place
                wait_for(lambda: httpx.get(server.url + "/load", timeout=5).json()["in_flight"] == 3, 10, "the queue")
                os.kill(core, signal.SIGCONT)
                answers = [queued.result(60), one_more.result(60)]
        finally:
            os.kill(core, signal.SIGCONT)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "engine_queue_full" and "max_waiting_requests" in error["message"]
        assert [a.status_code for a in answers] == [200, 200]
        assert len(answers[0].json()["choices"]) == 2


def test_a_core_that_says_ready_hands_its_first_load_report_with_it(tiny_chat_model, tmp_path):
    """The API server knows what the core serves (its pool, its LoRA adapters) from the moment the
    core says ready, not from its first periodic report 50 ms later: a request for an adapter the
    engine serves was a 404 in that window (seen once in a fresh-clone `make test`)."""
    from lora_adapters import write_random_adapter

    from kvharbor.common.config import config_from_argv
    from kvharbor.engine.config import ServeConfig
    from kvharbor.engine.model.loader import load_model
    from kvharbor.engine.serve.core_client import CoreClient

    arch = load_model(str(tiny_chat_model)).arch
    adapter = write_random_adapter(tmp_path / "a", arch, 4, seed=0)
    argv = ["--model", str(tiny_chat_model), "--num-kv-blocks", "64", "--lora", f"a={adapter}"]
    client = CoreClient(config_from_argv(ServeConfig, argv, "test", "test"))
    try:
        client.start_sync(timeout=120)
        assert client.load.kv_blocks_total == 64 and list(client.load.lora_adapters) == ["a"]
    finally:
        client.kill()
