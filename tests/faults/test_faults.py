"""The fault suite: real processes under a bounded load, one fault at a time, one table row each.

The platform: redis-server, the KV cache service, two engines (SmolLM2, bfloat16) and two gateways,
all on loopback. Each test injects one fault while streamed chats run through both gateways
(tests/faults/fault_load.py tells apart how each one ended), then restores the platform and
records how long that took. The goals (issue 20): no request lost before its first token and no
broken stream while another engine is healthy, none hung, limits exact after a Redis restart,
and no leaked slots or KV blocks at the end. The table is printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time

import httpx
import pytest
import redis
from fault_load import row, run_load, stream_chat, wait_until
from hostile import nested
from servers import (
    EngineServerProcess,
    GatewayProcess,
    KVCacheServiceProcess,
    RedisProcess,
    metric,
    start_together,
    write_tenants,
)

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# bfloat16, the default on AMX CPUs and GPUs (emulated where the CPU has none): a stream migrated
# after a SIGKILL must go on as it would have, which in bfloat16 needs batch-invariant engines
# (their default here; before them, five of six migrated greedy streams differed).
ENGINE_ARGS = ("--dtype", "bfloat16", "--num-kv-blocks", "256", "--max-model-len", "1024", "--drain-timeout", "20")
# Stalls past 4 s move a stream; an engine that has not answered in 6 s is passed over; the SLOs
# are loose so that admission never sheds this load (the faults are the point, not the SLOs).
GATEWAY_ARGS = ("--stream-idle-timeout", "4", "--first-token-timeout", "6", "--slo-ttft-ms", "60000",
                "--slo-itl-ms", "5000", "--load-interval", "0.25", "--max-migrations", "2")  # fmt: skip
TENANTS = [  # a concurrency limit, never reached, so that every request holds a slot (checked at the end)
    {"name": "load", "key": "sk-load", "limits": {"max_concurrent": 64}},
    {"name": "limited", "key": "sk-limited", "limits": {"rpm": 5}},
    {"name": "hostile", "key": "sk-hostile"},
]
REQUESTS, CONCURRENCY, DEADLINE_S = 8, 4, 90.0


def bodies(tag: str, n: int = REQUESTS, max_tokens: int = 24) -> list[dict]:
    return [{"model": MODEL, "messages": [{"role": "user", "content": f"Drill ({tag}): tell me about topic {i}."}],
             "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0} for i in range(n)]  # fmt: skip


class Platform:
    def __init__(self, logs) -> None:
        self.logs = logs
        write_tenants(logs / "tenants.yaml", TENANTS)
        self.redis = RedisProcess(logs / "redis").start()
        self.svc = KVCacheServiceProcess(logs, self.redis.url, "--lease-sweep-interval", "0.5")
        self.engines = [self._engine(name) for name in ("A", "B")]
        self.gateways: list[GatewayProcess] = []

    def _engine(self, name: str, port: int | None = None) -> EngineServerProcess:
        return EngineServerProcess(self.logs, "--instance-id", name, "--redis-url", self.redis.url, *ENGINE_ARGS,
                                   port=port)  # fmt: skip

    def _gateway(self, port: int | None = None) -> GatewayProcess:
        engines = ",".join(e.url for e in self.engines)
        return GatewayProcess(self.logs, "--engines", engines, "--tenants-file", str(self.logs / "tenants.yaml"),
                              "--redis-url", self.redis.url, *GATEWAY_ARGS, port=port)  # fmt: skip

    def start(self) -> Platform:
        start_together([self.svc, *self.engines])
        self.gateways = [self._gateway(), self._gateway()]
        for g in self.gateways:
            g.start()
        self.wait_healthy(60)
        return self

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gateways]

    def routable(self, gateway: GatewayProcess) -> float:
        return metric(httpx.get(gateway.admin_url + "/metrics", timeout=5).text, "kvharbor_gateway_engines_routable")

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until every part answers and both gateways route to both engines."""

        def healthy() -> bool:
            parts = [self.svc, *self.engines, *self.gateways]
            return all(httpx.get(p.url + "/ready", timeout=2).status_code == 200 for p in parts) and all(
                self.routable(g) == len(self.engines) for g in self.gateways
            )

        return wait_until(healthy, timeout, "the platform to be healthy")

    def restart_engine(self, i: int) -> None:
        old = self.engines[i]
        old.stop()
        self.engines[i] = self._engine(old.args[old.args.index("--instance-id") + 1], port=old.port).start()

    def busy_engine(self) -> int | None:
        for i, e in enumerate(self.engines):
            if httpx.get(e.url + "/load", timeout=2).json()["running"] > 0:
                return i
        return None

    def wait_busy(self) -> int:
        """The index of an engine running something, once one is."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            busy = self.busy_engine()
            if busy is not None:
                return busy
            time.sleep(0.05)
        raise AssertionError("no engine took the load within 30 s")

    def stop(self) -> None:
        for p in (*self.gateways, *self.engines, self.svc):
            p.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    p = Platform(tmp_path_factory.mktemp("faults"))
    try:
        yield p.start()
    finally:
        p.stop()


def drill(platform: Platform, fault: str, inject) -> int:
    """Run the load, `inject()` once it is flowing, wait until the platform is healthy again, and
    record the fault's row (recovery: from the injection until healthy). Checks that nothing was
    lost, broken or hung; returns the streams the gateways moved meanwhile."""
    before, refused_before = migrations(platform), refusals(platform.gateways)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = run_load(platform.urls, "sk-load", bodies(fault), CONCURRENCY, DEADLINE_S)
        outcomes = pool.submit(asyncio.run, load)
        platform.wait_busy()
        started = time.monotonic()
        inject()
        platform.wait_healthy(120)
        recovery = time.monotonic() - started
        results = outcomes.result(timeout=DEADLINE_S + 30)
    moved = migrations(platform) - before
    refused = refusals(platform.gateways)
    check(fault, results, recovery, moved, {r: n - refused_before.get(r, 0) for r, n in refused.items()})
    return moved


def check(fault: str, outcomes: list, recovery: float, moved: float, refused: dict | None = None) -> None:
    entry = row(fault, outcomes, recovery, moved, refused)
    bad = [o for o in outcomes if o.kind != "ok"]
    assert entry["hung"] == 0 and not bad, f"{fault}: {[(o.kind, o.detail) for o in bad]}"


def refusals(gateways: list[GatewayProcess]) -> dict[str, float]:
    """kvharbor_gateway_requests_refused_total by reason, summed over `gateways` (0 for one that is down)."""
    out: dict[str, float] = {}
    for g in gateways:
        try:
            text = httpx.get(g.admin_url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith('kvharbor_gateway_requests_refused_total{reason="'):
                reason = line.split('"')[1]
                out[reason] = out.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    return out


def migrations(platform: Platform) -> float:
    text = [httpx.get(g.admin_url + "/metrics", timeout=5).text for g in platform.gateways]
    return sum(metric(t, "kvharbor_gateway_stream_migrations_total", 'result="moved"') for t in text)


def test_engine_sigkill_mid_stream_migrates_and_greedy_output_is_unchanged(platform):
    exact = {**bodies("exact", 1, max_tokens=96)[0]}
    headers = {"Authorization": "Bearer sk-load"}
    whole = httpx.post(platform.urls[0] + "/v1/chat/completions", json=exact, headers=headers, timeout=120).json()
    moved_before = migrations(platform)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(asyncio.run, stream_chat(platform.urls[:1], "sk-load", exact, DEADLINE_S))
        victim = platform.engines[platform.wait_busy()]  # the one the stream runs on: nothing else runs yet
        load = pool.submit(asyncio.run, run_load(platform.urls, "sk-load", bodies("kill"), CONCURRENCY, DEADLINE_S))
        time.sleep(0.3)
        killed = time.monotonic()
        victim.signal(signal.SIGKILL)
        outcomes = [streamed.result(timeout=DEADLINE_S + 30), *load.result(timeout=DEADLINE_S + 30)]
    platform.restart_engine(platform.engines.index(victim))
    platform.wait_healthy(120)
    moved = migrations(platform) - moved_before
    check("engine SIGKILL mid-stream", outcomes, time.monotonic() - killed, moved)
    assert outcomes[0].text == whole["choices"][0]["message"]["content"]  # as if nothing had happened
    assert outcomes[0].usage["completion_tokens"] == 96
    assert outcomes[0].usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert moved >= 1


def test_engine_sigstop_for_10_s_then_sigcont(platform):
    def stall() -> None:
        engine = platform.engines[platform.wait_busy()]
        engine.signal(signal.SIGSTOP)
        try:
            time.sleep(10)
        finally:
            engine.signal(signal.SIGCONT)

    moved = drill(platform, "engine SIGSTOP 10 s, SIGCONT", stall)
    assert moved >= 1  # the streams on the stalled engine went on elsewhere after 4 s without a token


def test_redis_restart_keeps_serving_and_limits_stay_exact(platform):
    def restart() -> None:
        platform.redis.stop()
        time.sleep(1)
        platform.redis.start()  # same port, empty: the engines re-publish, the limits start over

    drill(platform, "Redis restart", restart)
    # Exact again: each gateway has used Redis since it came back, then 6 requests for an RPM of 5.
    for url in platform.urls:
        ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        httpx.post(url + "/v1/chat/completions", json=ok, headers={"Authorization": "Bearer sk-load"}, timeout=60)
    statuses = []
    for i in range(6):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"limit {i}"}], "max_tokens": 1}
        r = httpx.post(platform.urls[i % 2] + "/v1/chat/completions", json=body,
                       headers={"Authorization": "Bearer sk-limited"}, timeout=60)  # fmt: skip
        statuses.append(r.status_code)
    assert sorted(statuses) == [200] * 5 + [429], statuses


def test_kvcache_service_kill(platform):
    def kill() -> None:
        platform.svc.signal(signal.SIGKILL)
        platform.svc.wait(10)
        platform.svc.stop()  # closes its log
        platform.svc = KVCacheServiceProcess(platform.logs, platform.redis.url, "--lease-sweep-interval", "0.5",
                                             port=platform.svc.port).start()  # fmt: skip

    drill(platform, "KV cache service SIGKILL", kill)


def test_one_of_two_gateways_restarts(platform):
    def restart() -> None:
        old = platform.gateways[1]
        old.stop()  # SIGTERM: the gateway finishes open streams (up to its --drain-timeout), refuses new connections
        platform.gateways[1] = platform._gateway(port=old.port).start()

    drill(platform, "gateway restart (1 of 2)", restart)


def test_engine_sigterm_drains_under_load(platform):
    def drain() -> None:
        i = platform.wait_busy()
        platform.engines[i].signal(signal.SIGTERM)
        assert platform.engines[i].wait(60) == 0  # drained: its streams finished, then it exited
        platform.restart_engine(i)

    drill(platform, "engine SIGTERM drain", drain)


# Requests a tenant may send to harm others (issue 47): the engines refuse the first four (the
# gateway does not know the context or the vocabulary), the gateway the rest at its edge.
HOSTILE = [
    {"max_tokens": 5000}, {"min_tokens": 2000}, {"logit_bias": {"99999999": 5}}, {"stop_token_ids": [60000]},
    {"seed": 2**64 - 1, "n": 3, "temperature": 0.9}, {"n": 17},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": nested(60)}}},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": 7}}]}]},
]  # fmt: skip


def test_a_hostile_tenant_beside_the_load(platform):
    """A tenant's poison requests, streamed and not, through both gateways while the load runs:
    each is a 4xx naming its field; the load's streams are untouched (no retry, no ejection)."""
    answers = []

    def inject() -> None:
        for i, extra in enumerate(HOSTILE * 2):
            body = {**bodies("hostile", 1)[0], **extra, "stream": i % 2 == 0}
            resp = httpx.post(platform.urls[i % 2] + "/v1/chat/completions", json=body, timeout=30,
                              headers={"Authorization": "Bearer sk-hostile"})  # fmt: skip
            answers.append((extra, resp.status_code, resp.json()["error"].get("param")))

    before = sum(refusals(platform.gateways).values())
    drill(platform, "hostile tenant beside the load", inject)
    assert all(status == 400 and param for _, status, param in answers), answers
    assert sum(refusals(platform.gateways).values()) - before == 8  # the first four, twice: refused by engines


@pytest.fixture(scope="module")
def pd_gateway(platform, tmp_path_factory):
    """A P/D pair on the platform's Redis (a prefill and a decode engine) behind a gateway of its
    own that gives a prefill engine at least 3 s (--pd-prefill-deadline-s)."""
    logs = tmp_path_factory.mktemp("faults-pd")
    prefill = EngineServerProcess(logs, "--role", "prefill", "--instance-id", "P", *ENGINE_ARGS)
    decode = EngineServerProcess(logs, "--role", "decode", "--instance-id", "D", *ENGINE_ARGS)
    procs = [prefill, decode]
    try:
        start_together(procs)
        gateway = GatewayProcess(
            logs, "--engines", f"{prefill.url},{decode.url}", "--tenants-file", str(platform.logs / "tenants.yaml"),
            "--redis-url", platform.redis.url, *GATEWAY_ARGS, "--pd-min-gain-ms", "0", "--pd-prefill-deadline-s", "3",
        )  # fmt: skip
        procs.append(gateway)
        gateway.start()
        wait_until(lambda: platform.routable(gateway) == 2, 60, "the P/D gateway to route to both engines")
        yield {"prefill": prefill, "decode": decode, "gateway": gateway}
    finally:
        for p in reversed(procs):
            p.stop()


def test_prefill_engine_sigstop_under_pd(platform, pd_gateway):
    # A stopped prefill engine accepts connections and never answers: each request must fall back
    # to prefilling on the decode engine at its deadline instead of waiting out the request timeout.
    gateway, prefill = pd_gateway["gateway"], pd_gateway["prefill"]
    system = "You are a careful assistant for a shipping company. " * 24  # ~300 tokens: worth a hand-off
    chats = bodies("pd", 4, max_tokens=48)
    load = [{**b, "messages": [{"role": "system", "content": system}, *b["messages"]]} for b in chats]
    prefill.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        outcomes = asyncio.run(run_load([gateway.url], "sk-load", load, 2, DEADLINE_S))
    finally:
        prefill.signal(signal.SIGCONT)
    recovery = wait_until(lambda: platform.routable(gateway) == 2, 60, "the prefill engine back in rotation")
    check("P/D prefill engine SIGSTOP", outcomes, time.monotonic() - stopped, 0)
    gw = httpx.get(gateway.admin_url + "/metrics", timeout=5).text
    timeouts = metric(gw, "kvharbor_gateway_pd_decisions_total", 'reason="prefill_timeout"')
    assert timeouts >= 1  # then the engine is ejected, and the rest are prefill_down until it is back
    assert recovery < 60


def test_nothing_leaked_after_the_faults(platform):
    def idle() -> bool:
        loads = [httpx.get(e.url + "/load", timeout=2).json() for e in platform.engines]
        return all(
            r["running"] == r["waiting"] == r["in_flight"] == r["kv_pinned_blocks"] == 0
            and r["kv_blocks_free"] == r["kv_blocks_total"]
            for r in loads
        )

    wait_until(idle, 30, "every engine idle with every KV block free")
    client = redis.Redis.from_url(platform.redis.url)
    slots = [k for k in client.scan_iter("kvharbor:rl:*") if k.endswith(b":conc") and client.zcard(k)]
    assert slots == [], "concurrency slots left behind"
