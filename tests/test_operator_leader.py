"""Leader election on a coordination.k8s.io/v1 Lease (operator/leader.py): the elector against the
test-only API double (fast, no process), then two real `kvharbor operator` processes against it (slow):
only the leader writes, and the standby takes over when the leader is killed, stopped or loses the Lease.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

import httpx
import pytest
from kube_api_double import KubeAPIDouble
from servers import OperatorProcess, wait_for

from kvharbor.common.config import ConfigError, load_config
from kvharbor.common.kube import Kube, KubeError
from kvharbor.operator.config import OperatorConfig
from kvharbor.operator.leader import LeaderElector, LeadershipLost, default_identity, lease_path

NS, NAME = "kvharbor", "kvharbor-operator"
LEASE_API = "coordination.k8s.io/v1"


class Clock:
    """A hand-moved monotonic clock (and a wall clock 1e9 s ahead of it), for expiry without sleeping."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1e9 + self.t


@pytest.fixture
def api():
    with KubeAPIDouble() as double:
        yield double


def lease(api: KubeAPIDouble) -> dict:
    return (api.get(LEASE_API, "Lease", NAME, NS) or {}).get("spec") or {}


def elector(kube: Kube, identity: str, clock: Clock | None = None, **timing) -> LeaderElector:
    timing = {"lease_duration": 3, "renew_deadline": 2.0, "retry_interval": 0.5, **timing}
    clocks = {"clock": clock, "wall_clock": clock.wall} if clock else {}
    return LeaderElector(kube, namespace=NS, name=NAME, identity=identity, **timing, **clocks)


def run(api: KubeAPIDouble, body, kube_class=Kube):
    async def main():
        kube = kube_class(httpx.AsyncClient(base_url=api.url, timeout=5))
        try:
            return await body(kube)
        finally:
            await kube.close()

    return asyncio.run(main())


# --- the elector -----------------------------------------------------------------------------------


def test_the_first_candidate_creates_the_lease_and_leads(api):
    clock = Clock()

    async def body(kube):
        a = elector(kube, "a", clock)
        assert await a.try_acquire_or_renew()
        first = lease(api)
        clock.t = 1.0
        assert await a.try_acquire_or_renew()  # a renewal: same acquireTime, new renewTime, no transition
        return first

    first = run(api, body)
    spec = lease(api)
    assert first["holderIdentity"] == spec["holderIdentity"] == "a"
    assert first["leaseDurationSeconds"] == 3 and first["leaseTransitions"] == spec["leaseTransitions"] == 0
    assert spec["acquireTime"] == first["acquireTime"] == first["renewTime"] == "2001-09-09T01:46:40.000000Z"
    assert spec["renewTime"] == "2001-09-09T01:46:41.000000Z"


def test_a_standby_takes_over_only_a_full_lease_duration_after_it_last_saw_the_lease_change(api):
    clock = Clock()

    async def body(kube):
        a, b = elector(kube, "a", clock), elector(kube, "b", clock)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew() and b.holder == "a"  # b first sees a's record at t=0
        clock.t = 2.5
        assert await a.try_acquire_or_renew()  # a renews: the record changes
        clock.t = 2.9
        assert not await b.try_acquire_or_renew()  # b sees the renewal at 2.9: it waits until 5.9
        clock.t = 5.8
        assert not await b.try_acquire_or_renew()
        clock.t = 5.9
        assert await b.try_acquire_or_renew()
        clock.t = 6.0
        assert not await a.try_acquire_or_renew() and a.holder == "b"  # the old leader sees it lost

    run(api, body)
    spec = lease(api)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"] == "2001-09-09T01:46:45.900000Z"


def test_two_candidates_racing_for_an_expired_lease_cannot_both_win(api):
    """Both read the same resourceVersion before either writes: the second PUT gets 409 Conflict."""
    clock = Clock()
    reads = {"n": 0}

    class BothReadFirst(Kube):
        async def get(self, url):
            found = await super().get(url)
            if url.endswith(f"/leases/{NAME}"):
                reads["n"] += 1
                while reads["n"] % 2:  # the first reader waits for the second
                    await asyncio.sleep(0.01)
            return found

    async def body(kube):
        old = elector(Kube(httpx.AsyncClient(base_url=api.url)), "old", clock)
        assert await old.try_acquire_or_renew()
        await old.kube.close()
        b, c = elector(kube, "b", clock), elector(kube, "c", clock)
        reads["n"] = 0
        await asyncio.gather(b.try_acquire_or_renew(), c.try_acquire_or_renew())  # both see "old" at t=0
        clock.t = 3.0
        reads["n"] = 0
        return await asyncio.gather(b.try_acquire_or_renew(), c.try_acquire_or_renew())

    won = run(api, body, BothReadFirst)
    assert sorted(won) == [False, True]
    assert lease(api)["holderIdentity"] == ("b" if won[0] else "c") and lease(api)["leaseTransitions"] == 1


def test_two_candidates_creating_the_lease_at_once_cannot_both_win(api):
    async def body(kube):
        return await asyncio.gather(*(elector(kube, name).try_acquire_or_renew() for name in "abcd"))

    assert sorted(run(api, body)) == [False, False, False, True]


class Breakable(Kube):
    """A Kube whose lease calls fail (or hang) once `mode` is set."""

    mode = ""

    async def _json(self, method, url, **kwargs):
        if "/leases" in url and self.mode == "error":
            raise KubeError(0, f"{method} {url}: Kubernetes API unreachable")
        if "/leases" in url and self.mode == "hang":
            await asyncio.sleep(3600)
        return await super()._json(method, url, **kwargs)


@pytest.mark.parametrize("mode", ["error", "hang"])
def test_a_leader_that_cannot_renew_stops_at_the_renew_deadline(api, mode, caplog):
    """On the hand-moved clock, so a loaded machine cannot move the deadline: still leading just before
    renew_deadline after its last renewal, lost (with one log line) once the deadline has passed."""
    clock = Clock()

    async def body(kube):
        a = elector(kube, "a", clock, lease_duration=2, renew_deadline=0.6, retry_interval=0.1)
        await a.acquire()
        holding = asyncio.create_task(a.hold())
        clock.t = 0.3
        await until(lambda: lease(api)["renewTime"] == "2001-09-09T01:46:40.300000Z")  # renewed at 0.3
        kube.mode = mode
        clock.t = 0.3 + 0.55
        await asyncio.sleep(0.5)  # several retry intervals of failing renewals
        still_leading = not holding.done() and a.role == "leader"
        clock.t = 0.3 + 0.6
        with pytest.raises(LeadershipLost, match=r"no renewal for 0\.6 s"):
            await asyncio.wait_for(holding, timeout=10)
        return a, still_leading

    with caplog.at_level(logging.INFO, "kvharbor.operator.leader"):
        a, still_leading = run(api, body, Breakable)
    assert still_leading and a.role == "lost"
    lost = [r for r in caplog.records if r.getMessage().startswith("lost the lease")]  # once, with who and what
    assert len(lost) == 1 and lost[0].identity == "a" and lost[0].lease == f"{NS}/{NAME}"


async def until(condition, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def test_a_leader_whose_lease_another_took_stops_at_its_next_renewal(api):
    clock = Clock()  # never moved: the renew deadline cannot be what stops it

    async def body(kube):
        a = elector(kube, "a", clock, lease_duration=5, renew_deadline=4, retry_interval=0.1)
        await a.acquire()
        taken = api.get(LEASE_API, "Lease", NAME, NS)
        taken["spec"]["holderIdentity"] = "intruder"
        api.apply(taken)
        with pytest.raises(LeadershipLost, match="held by intruder"):
            await asyncio.wait_for(a.hold(), timeout=10)
        return a

    assert run(api, body).role == "lost"


def test_a_released_lease_is_taken_at_the_next_attempt(api):
    clock = Clock()

    async def body(kube):
        a, b = elector(kube, "a", clock), elector(kube, "b", clock)
        assert await a.try_acquire_or_renew()
        a.role = "leader"
        assert not await b.try_acquire_or_renew()
        assert await a.release() and a.role == "released"
        assert not await a.release()  # only once, and only a lease it holds
        return await b.try_acquire_or_renew()  # no wait for the lease duration

    assert run(api, body)
    spec = lease(api)
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1 and spec["leaseDurationSeconds"] == 3


def test_acquire_logs_standby_once_per_holder_then_acquired(api, caplog):
    clock = Clock()

    async def body(kube):
        holder = elector(kube, "a", clock, lease_duration=1, renew_deadline=0.5, retry_interval=0.05)
        await holder.acquire()
        b = elector(kube, "b", clock, lease_duration=1, renew_deadline=0.5, retry_interval=0.05)
        acquiring = asyncio.create_task(b.acquire())  # a never renews: b takes over a lease duration later
        await asyncio.sleep(0.3)
        clock.t = 0.95
        await asyncio.sleep(0.3)
        waited = not acquiring.done() and b.role == "standby"
        clock.t = 1.0
        await asyncio.wait_for(acquiring, timeout=10)
        return b, waited

    with caplog.at_level(logging.INFO, "kvharbor.operator.leader"):
        b, waited = run(api, body)
    assert waited and b.role == "leader"
    records = [r for r in caplog.records if r.name == "kvharbor.operator.leader"]
    messages = [(r.getMessage().split(":")[0], r.identity) for r in records]
    assert messages == [("acquired the lease", "a"), ("standby", "b"), ("acquired the lease", "b")]
    assert all(r.lease == f"{NS}/{NAME}" for r in records)
    assert records[1].holder == "a"


def test_the_double_serves_leases_and_tells_listeners_apart(api):
    second = api.listen()
    with httpx.Client(base_url=api.url) as one, httpx.Client(base_url=second) as two:
        groups = {g["name"] for g in one.get("/apis").json()["groups"]}
        assert "coordination.k8s.io" in groups
        assert {r["name"] for r in one.get("/apis/coordination.k8s.io/v1").json()["resources"]} == {"leases"}
        body = {"metadata": {"name": NAME}, "spec": {"holderIdentity": "x"}}
        assert one.post(lease_path(NS), json=body).status_code == 201
        read = two.get(lease_path(NS, NAME)).json()
        stale = {**read, "spec": {"holderIdentity": "y"}}
        assert two.put(lease_path(NS, NAME), json=stale).status_code == 200
        assert one.put(lease_path(NS, NAME), json=stale).status_code == 409  # its resourceVersion is stale now
    assert api.writes_via == [("POST", lease_path(NS), api.url), ("PUT", lease_path(NS, NAME), second)]


# --- configuration ---------------------------------------------------------------------------------


def test_leader_election_options_have_defaults_and_env_names():
    config = load_config(OperatorConfig, env={})
    leader = config.leader
    assert (leader.leader_election, leader.lease_name, leader.lease_namespace) == (True, NAME, "")
    assert (leader.lease_duration, leader.renew_deadline, leader.retry_interval) == (15, 10.0, 2.0)
    env = {"KVHARBOR_LEADER_ELECTION": "false", "KVHARBOR_LEASE_DURATION": "3", "KVHARBOR_RENEW_DEADLINE": "2",
           "KVHARBOR_RETRY_INTERVAL": "0.5", "KVHARBOR_TENANTS_NAMESPACE": "prod"}  # fmt: skip
    config = load_config(OperatorConfig, env=env)
    assert not config.leader.leader_election and config.leader.lease_duration == 3
    elected = LeaderElector.from_config(None, config, identity="me")
    assert elected.lease == "prod/kvharbor-operator" and elected.retry_interval == 0.5  # the tenants namespace
    config = load_config(OperatorConfig, env={}, overrides={"lease_namespace": "ops"})
    assert LeaderElector.from_config(None, config, identity="me").namespace == "ops"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"renew_deadline": 15}, r"renew_deadline \(15 s\) must be shorter than lease_duration \(15 s\)"),
        ({"lease_duration": 5}, r"renew_deadline \(10 s\) must be shorter than lease_duration \(5 s\)"),
        ({"retry_interval": 10}, r"retry_interval \(10 s\) must be > 0 and shorter than renew_deadline \(10 s\)"),
        ({"retry_interval": 0}, r"retry_interval \(0 s\) must be > 0"),
        ({"lease_duration": 0}, "lease_duration must be at least 1 second"),
        ({"lease_duration": 2.5}, "lease_duration=2.5 .*must be an integer"),
        ({"lease_name": ""}, "lease_name must not be empty"),
    ],
)
def test_bad_election_timings_are_refused_with_the_reason(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(OperatorConfig, env={}, overrides=overrides)


def test_the_identity_is_the_pod_name_and_the_pid():
    assert default_identity({"POD_NAME": "kvh-operator-7d9-x2", "HOSTNAME": "h"}, pid=7) == "kvh-operator-7d9-x2_7"
    assert default_identity({"HOSTNAME": "h"}, pid=7) == "h_7"


# --- two real operator processes -------------------------------------------------------------------

CRDS = sorted((Path(__file__).resolve().parent.parent / "charts" / "kvharbor" / "crds").glob("*.yaml"))
LEASE_DURATION, RETRY = 3, 0.5
TIMING = ["--lease-duration", str(LEASE_DURATION), "--renew-deadline", "2", "--retry-interval", str(RETRY)]


def inference_service(name: str) -> dict:
    return {"apiVersion": "kvharbor.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "inference"},
            "spec": {"model": {"source": "/models/llama", "name": "Llama-3.1-8B-Instruct", "maxModelLen": 8192},
                     "replicas": {"min": 1, "max": 1}, "engine": {"maxNumSeqs": 16}}}  # fmt: skip


def deployment(api: KubeAPIDouble, service: str) -> dict | None:
    return api.get("apps/v1", "Deployment", f"{service}-engine", "inference")


def health(process: OperatorProcess) -> dict:
    return httpx.get(process.url + "/healthz", timeout=2).json()


@pytest.mark.slow
def test_two_operator_processes_one_acts_and_the_standby_takes_over(tmp_path, capsys):
    from test_operator_placement import node

    processes: list[OperatorProcess] = []

    def operator(api: KubeAPIDouble, pod: str) -> tuple[OperatorProcess, str]:
        url = api.listen()  # a listener of its own: its writes are told apart in api.writes_via
        kubeconfig = api.write_kubeconfig(tmp_path / f"{pod}.kubeconfig", url=url)
        process = OperatorProcess(tmp_path, kubeconfig, "--interval", "1", "--tenants-namespace", NS,
                                  "--no-log-json", *TIMING)  # fmt: skip
        process.env["POD_NAME"] = pod
        processes.append(process)
        return process.start(timeout=60), url

    def writes_by(url: str) -> list[tuple[str, str]]:
        return [(method, path) for method, path, via in api.writes_via if via == url]

    with KubeAPIDouble(CRDS) as api:
        api.create(node("l4-0", "l4", 4, "NVIDIA-L4", 23034))
        try:
            a, a_url = operator(api, "operator-a")
            wait_for(lambda: lease(api).get("holderIdentity") == f"operator-a_{a.proc.pid}", 30, "a to lead")
            b, b_url = operator(api, "operator-b")
            wait_for(lambda: health(b)["role"] == "standby", 30, "b to stand by")
            assert health(b)["holder"] == f"operator-a_{a.proc.pid}" and health(a)["role"] == "leader"

            api.create(inference_service("first"))
            wait_for(lambda: deployment(api, "first"), 30, "the leader to deploy the first service")
            wait_for(lambda: api.get("v1", "Secret", "kvharbor-gateway-tenants", NS), 30, "the tenants Secret")
            time.sleep(2 * RETRY)
            assert writes_by(b_url) == []  # the standby wrote nothing at all, not even the lease
            assert ("POST", "/apis/apps/v1/namespaces/inference/deployments") in writes_by(a_url)
            assert ("PUT", lease_path(NS, NAME)) in writes_by(a_url)  # renewals

            # kill -9: no release; the standby waits out the lease duration.
            killed = time.monotonic()
            a.signal(signal.SIGKILL)
            a.wait(10)
            api.create(inference_service("second"))
            wait_for(lambda: lease(api).get("holderIdentity") == f"operator-b_{b.proc.pid}", 30, "b to take over")
            took_lease = time.monotonic() - killed
            wait_for(lambda: deployment(api, "second"), 30, "the new leader to deploy the second service")
            reconciled = time.monotonic() - killed
            assert ("POST", "/apis/apps/v1/namespaces/inference/deployments") in writes_by(b_url)
            assert lease(api)["leaseTransitions"] == 1 and health(b)["role"] == "leader"

            # SIGTERM: the leader stops kopf, releases the lease and exits 0; the standby need not wait.
            c, _ = operator(api, "operator-c")
            wait_for(lambda: health(c)["role"] == "standby", 30, "c to stand by")
            stopped = time.monotonic()
            b.signal(signal.SIGTERM)
            assert b.wait(30) == 0
            wait_for(lambda: lease(api).get("holderIdentity") == f"operator-c_{c.proc.pid}", 30, "c to take over")
            handed_over = time.monotonic() - stopped

            # A leader that finds another holder in its Lease exits 1 at its next renewal.
            taken = api.get(LEASE_API, "Lease", NAME, NS)
            taken["spec"]["holderIdentity"] = "intruder"
            api.apply(taken)
            assert c.wait(10) == 1
            assert "lost the lease: this replica stops acting" in c.log()
        finally:
            for process in processes:
                process.stop()
    with capsys.disabled():
        print(f"\nleader killed -> standby holds the lease in {took_lease:.2f} s, has reconciled a new service in "
              f"{reconciled:.2f} s (lease {LEASE_DURATION} s, retry {RETRY} s); SIGTERM hand-over {handed_over:.2f} s")
    # Behavioural bounds, not speed targets: the lease expires, then kopf starts and reconciles.
    assert LEASE_DURATION - 2 <= took_lease <= LEASE_DURATION + 2 * RETRY + 3  # 2: the renew deadline
    assert reconciled <= LEASE_DURATION + 2 * RETRY + 20
    assert handed_over < LEASE_DURATION  # released: no wait for the expiry
