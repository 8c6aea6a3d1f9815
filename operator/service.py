"""`kvharbor operator`: reconcile InferenceService and Tenant resources onto the cluster (kopf).

It places each InferenceService on a GPU node pool that fits, runs its engines (Deployment,
Service, PodDisruptionBudget, ConfigMap), scales them on load, drains and cleans them up, and
turns Tenants into the gateway's tenants Secret. Credentials: the in-cluster service account,
else $KUBECONFIG. Options are flags, KVHARBOR_* variables or a YAML file (--config).

With leader election (the default) every replica serves /healthz at once, stands by until it holds
the Lease (operator/leader.py), and only then starts kopf's handlers; see run_elected.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from kvharbor.common.config import config_from_argv
from kvharbor.common.logs import setup_logging
from kvharbor.common.redis_client import credentials_refused
from kvharbor.operator.leader import LeadershipLost

log = logging.getLogger("kvharbor.operator")


def main(argv: list[str], prog: str = "kvharbor operator", command: str = "operator") -> int:
    from kvharbor.operator.config import OperatorConfig

    config = config_from_argv(OperatorConfig, argv, prog, __doc__.splitlines()[0])
    setup_logging(config.server.log_level, config.server.log_json)
    if credentials_refused(config.engine.redis_url, prog):  # a wrong password stops here, not in deletions
        return 2
    return run(config)


def run(config) -> int:
    import kopf

    from kvharbor.operator.handlers import register

    registry = kopf.OperatorRegistry()
    register(registry, config)
    namespaces = config.watch.namespace_list()
    host, port = config.server.host, config.server.port
    log.info(
        "starting operator",
        extra={
            "namespaces": namespaces or "all",
            "redis": bool(config.engine.redis_url),
            "image": config.engine.engine_image,
            "leader_election": config.leader.leader_election,
        },
    )
    if config.leader.leader_election:
        return asyncio.run(run_elected(config, registry))
    # Without election this process acts alone: run no second replica then.
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=f"http://{host}:{port}/healthz" if port else None,
    )
    return 0


class KopfThread:
    """kopf's operator in a thread of its own, with its own event loop, started once this replica leads.

    It runs standalone=True: kopf's own peering is not used, because replicas of equal priority (every
    replica of one Deployment) all pause in favour of each other, so none would act; the Lease decides
    who acts instead. In a thread kopf ignores OS signals ("running not in the main thread"): the main
    loop handles them and stops kopf through its stop flag."""

    def __init__(self, registry, config, done: asyncio.Event) -> None:
        self.registry, self.config, self.done = registry, config, done
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kopf", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stop_flag.set()

    def _run(self) -> None:
        import kopf

        namespaces = self.config.watch.namespace_list()
        try:
            kopf.run(registry=self.registry, standalone=True, clusterwide=not namespaces, namespaces=namespaces,
                     stop_flag=self.stop_flag)  # fmt: skip
        except BaseException as exc:  # reported by the main loop, which exits non-zero
            self.error = exc
        finally:
            self._loop.call_soon_threadsafe(self.done.set)


async def run_elected(config, registry, identity: str | None = None) -> int:
    """Stand by until this replica holds the Lease, then run kopf while renewing it.

    Exit status: 0 after SIGTERM/SIGINT (the leader first stops kopf, then releases the Lease so a
    standby takes over at once); 1 when kopf ends by itself; 1 at once (os._exit, nothing more runs)
    when the leader loses the Lease, so that Kubernetes restarts it as a standby and never two act."""
    from kvharbor.common.kube import Kube
    from kvharbor.operator.leader import LeaderElector

    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    kube = Kube.from_environment()
    elector = LeaderElector.from_config(kube, config, identity)
    health = await _serve_health(config, elector)
    log.info("leader election: standing by until this replica holds the lease",
             extra={"identity": elector.identity, "lease": elector.lease,
                    "lease_duration": elector.lease_duration, "renew_deadline": elector.renew_deadline})  # fmt: skip
    try:
        stop_wait = asyncio.create_task(stopping.wait())
        acquiring = asyncio.create_task(elector.acquire())
        await asyncio.wait({acquiring, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not acquiring.done():
            acquiring.cancel()
            log.info("stopped while standing by", extra={"identity": elector.identity, "lease": elector.lease})
            return 0
        acquiring.result()
        kopf_done = asyncio.Event()
        kopf_thread = KopfThread(registry, config, kopf_done)
        kopf_thread.start()
        holding = asyncio.create_task(elector.hold())
        kopf_wait = asyncio.create_task(kopf_done.wait())
        await asyncio.wait({holding, kopf_wait, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if stop_wait.done() and not holding.done():
            kopf_thread.stop()  # graceful: kopf finishes its handlers while we keep the lease
            await asyncio.wait({holding, kopf_wait}, return_when=asyncio.FIRST_COMPLETED)
        if holding.done():
            _exit_now(holding)
        holding.cancel()
        await elector.release()
        if kopf_thread.error is not None or not stopping.is_set():
            log.error("kopf stopped by itself", extra={"identity": elector.identity, "error": repr(kopf_thread.error)})
            return 1
        return 0
    finally:
        if health is not None:
            await health.cleanup()
        await kube.close()


def _exit_now(holding: asyncio.Task) -> None:
    """Leadership is gone (or its renewal broke): stop every write now, kopf's included, by exiting."""
    exc = None if holding.cancelled() else holding.exception()
    if exc is not None and not isinstance(exc, LeadershipLost):
        log.error("lease renewal failed unexpectedly: stopping", exc_info=exc)
    logging.shutdown()
    os._exit(1)


async def _serve_health(config, elector):
    """/healthz answers 200 on every replica, saying whether it leads: a standby is healthy too."""
    from aiohttp import web

    host, port = config.server.host, config.server.port
    if not port:
        return None

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": elector.role, "identity": elector.identity,
                                  "lease": elector.lease, "holder": elector.holder})  # fmt: skip

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
