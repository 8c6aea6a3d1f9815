"""`kvharbor up` as a real subprocess: the whole platform answers through the gateway, a killed
engine is restarted while the other serves, SIGTERM leaves no child behind, Redis can be embedded
or external, and a start-up that fails half-way cleans up after itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import redis
from servers import RedisProcess, free_port, wait_for, write_tenants

pytestmark = pytest.mark.slow  # real `kvharbor up` platforms

MODEL = "SmolLM2-135M-Instruct"


def children_of(pid: int) -> dict[int, str]:
    """Live child processes of `pid`: pid -> command line."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def marked(mark: str) -> list[int]:
    """Live processes whose environment carries `mark` (children inherit it, even orphaned)."""
    needle = f"KVHARBOR_TEST_MARK={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class Up:
    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.mark = uuid.uuid4().hex
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{free_port()}"
        self.log_path = tmp / f"up-{self.port}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, **(env or {}), "KVHARBOR_TEST_MARK": self.mark}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvharbor.launch.cli", "up", "--port", str(self.port),
             "--admin-port", self.admin_url.rsplit(":", 1)[1], *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip

    def text(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 300) -> None:
        wait_for(lambda: self.proc.poll() is not None or "ready. Try:" in self.text(), timeout=timeout, what="up")
        assert self.proc.poll() is None, self.text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    write_tenants(tmp / "tenants.yaml", [{"name": "acme", "key": "sk-acme"}])
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVHARBOR_REDIS_URL")}
    env["PATH"] = "/usr/bin:/bin"  # no redis-server on PATH: `up` must embed its own
    up = Up(tmp, "--engines", "2", "--num-kv-blocks", "256", "--dtype", "float32",
            "--tenants-file", str(tmp / "tenants.yaml"), env=env)  # fmt: skip
    try:
        up.wait_ready()
        yield up
    finally:
        up.stop()


def test_the_platform_answers_through_the_gateway(platform):
    client = openai.OpenAI(base_url=platform.url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == [MODEL]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8)
    assert resp.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    text = platform.text()
    for name in ("redis", "kvcache", "engine-0", "engine-1", "gateway"):
        assert name in text  # the status table
    # The printed curl line, as a newcomer would paste it, answers the question (greedy).
    (curl,) = [line for line in text.splitlines() if line.startswith("curl -s ")]
    body = json.loads(curl.split(" -d '", 1)[1].rsplit("'", 1)[0])
    url = curl.split()[2]
    answer = httpx.post(url, json=body, headers={"Authorization": "Bearer sk-acme"}, timeout=120).json()
    assert answer["choices"][0]["message"]["content"] == "The capital of France is Paris."
    # The gateway's metrics are on the admin listener `up` prints, not on the tenants' port.
    assert f"gateway metrics on {platform.admin_url}/metrics" in text
    assert "kvharbor_gateway_requests_total" in httpx.get(platform.admin_url + "/metrics", timeout=10).text
    assert httpx.get(platform.url + "/metrics", timeout=10).status_code == 404


def test_a_killed_engine_is_restarted_while_the_other_serves(platform):
    client = openai.OpenAI(base_url=platform.url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)
    kids = children_of(platform.proc.pid)
    (victim,) = [pid for pid, cmd in kids.items() if "engine-0" in cmd]
    os.kill(victim, signal.SIGKILL)
    for i in range(3):  # served by engine-1 meanwhile
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2)
    wait_for(lambda: "restarted engine-0" in platform.text(), timeout=30, what="restart")
    wait_for(lambda: "engine-0 is back" in platform.text(), timeout=240, what="engine back")
    assert "exited with" in platform.text()


def test_sigterm_leaves_no_child_behind(platform):
    kids = children_of(platform.proc.pid)
    assert len([c for c in kids.values() if "kvharbor" in c]) == 4  # kvcache, two engines, gateway
    assert any("redis-server" in c for c in kids.values())
    tmp_dirs = {
        line.split("logs in ", 1)[1].split(";")[0] for line in platform.text().splitlines() if "logs in " in line
    }
    assert platform.stop() == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in kids):
        time.sleep(0.2)
    assert not [pid for pid in kids if alive(pid)], "a child outlived `kvharbor up`"
    assert not marked(platform.mark)
    assert all(not Path(d).exists() for d in tmp_dirs)  # the temporary directory is gone


def test_external_redis_via_redis_url(tmp_path, tiny_chat_model):
    with RedisProcess(tmp_path / "redis") as rds:
        write_tenants(tmp_path / "t.yaml", [{"name": "acme", "key": "sk-acme"}])
        # Redis is the point here, not SmolLM2: the tiny chat model starts in seconds.
        up = Up(tmp_path, "--engines", "1", "--num-kv-blocks", "128", "--tenants-file", str(tmp_path / "t.yaml"),
                "--model", str(tiny_chat_model), env={"REDIS_URL": rds.url})  # fmt: skip
        try:
            up.wait_ready()
            assert f"using Redis at {rds.url}" in up.text()
            headers = {"Authorization": "Bearer sk-acme"}
            body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            assert (
                httpx.post(up.url + "/v1/chat/completions", json=body, headers=headers, timeout=120).status_code == 200
            )
            wait_for(
                lambda: redis.Redis.from_url(rds.url).hlen("kvharbor:kv:streams"), what="KV events in that Redis"
            )
        finally:
            assert up.stop() == 0


def test_a_failed_start_cleans_up(tmp_path):
    up = Up(tmp_path, "--engines", "1", "--model", str(tmp_path / "missing.gguf"), "--ready-timeout", "60")
    assert up.proc.wait(120) == 1
    text = up.text()
    assert "engine-0 exited with" in text and "does not exist" in text
    assert "stopped" in text
    assert not marked(up.mark), "a process started by the failed `up` is still running"
