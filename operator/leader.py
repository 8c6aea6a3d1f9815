"""Leader election on a coordination.k8s.io/v1 Lease, the way client-go's leaderelection does it, so that
of several operator replicas exactly one acts and the others stand by.

The Lease's spec is the election record: holderIdentity, leaseDurationSeconds, acquireTime, renewTime,
leaseTransitions. Every attempt reads the Lease and writes it back with the resourceVersion it read
(PUT), so of two candidates that read the same version only one write succeeds: the other gets 409
Conflict and stays a standby.

- A standby retries every `retry_interval`. It takes the Lease only when it is free (no holder: a leader
  released it on a graceful stop) or when its record has not changed for the record's
  leaseDurationSeconds, timed on the standby's own monotonic clock from the moment its read of that
  record returned (renewTime is never compared across machines' clocks, so clock skew does not matter).
- The leader counts its renewal from the moment it started writing, which is earlier than any
  standby can have seen the write: both errors go the safe way.
- The leader renews every `retry_interval`. When no renewal has succeeded for `renew_deadline`, or the
  Lease names another holder, `hold()` raises LeadershipLost: the caller must stop acting at once.
  renew_deadline < lease_duration leaves the leader lease_duration - renew_deadline seconds to stop
  before any standby may take over, so there are never two writers.

Takeover after a leader dies without releasing: between lease_duration - retry_interval (it died just
before its next renewal) and lease_duration + 2 x retry_interval (the standby saw the last renewal up to
one retry late, and tries again up to one retry after the expiry), plus what the new leader needs to
start acting.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import quote

from kvharbor.common.kube import Kube, KubeError

log = logging.getLogger("kvharbor.operator.leader")

LEASE_API_VERSION = "coordination.k8s.io/v1"
Role = Literal["candidate", "standby", "leader", "lost", "released"]


class LeadershipLost(RuntimeError):
    """The leader could not renew its Lease in time, or found another holder: it must stop acting now."""


def default_identity(env: Mapping[str, str] | None = None, pid: int | None = None) -> str:
    """`<pod name>_<pid>`: POD_NAME (the chart sets it from the downward API), else HOSTNAME, else the host name."""
    env = os.environ if env is None else env
    host = env.get("POD_NAME") or env.get("HOSTNAME") or socket.gethostname()
    return f"{host}_{os.getpid() if pid is None else pid}"


def lease_path(namespace: str, name: str | None = None) -> str:
    tail = f"/{quote(name)}" if name else ""
    return f"/apis/{LEASE_API_VERSION}/namespaces/{quote(namespace)}/leases{tail}"


def micro_time(epoch: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC), as acquireTime and renewTime are."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One candidate for the Lease `namespace/name`. `acquire()` returns once it leads; `hold()` renews
    until leadership is lost (it raises LeadershipLost); `release()` gives the Lease up on a graceful stop.

    `role` and `holder` (the last holder seen) are for /healthz and the logs."""

    def __init__(
        self,
        kube: Kube,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: int = 15,
        renew_deadline: float = 10.0,
        retry_interval: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 < retry_interval < renew_deadline < lease_duration:
            raise ValueError("need 0 < retry_interval < renew_deadline < lease_duration")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_duration, self.renew_deadline, self.retry_interval = lease_duration, renew_deadline, retry_interval
        self._clock, self._wall_clock = clock, wall_clock
        self.role: Role = "candidate"
        self.holder: str | None = None
        self._observed: dict | None = None  # the Lease spec last seen, and when (our monotonic clock)
        self._observed_at = 0.0
        self._renewed_at = 0.0  # when the last successful write of ours started

    @classmethod
    def from_config(cls, kube: Kube, config: Any, identity: str | None = None) -> LeaderElector:
        """From an OperatorConfig: its LeaderConfig, the Lease in lease_namespace or else tenants_namespace."""
        leader = config.leader
        return cls(
            kube,
            namespace=leader.lease_namespace or config.tenants.tenants_namespace,
            name=leader.lease_name,
            identity=identity or default_identity(),
            lease_duration=leader.lease_duration,
            renew_deadline=leader.renew_deadline,
            retry_interval=leader.retry_interval,
        )

    @property
    def lease(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _fields(self) -> dict[str, Any]:
        return {"identity": self.identity, "lease": self.lease}

    # --- one attempt ---------------------------------------------------------------------------------

    async def try_acquire_or_renew(self) -> bool:
        """One read and at most one write: True when this candidate holds the Lease afterwards."""
        started, now = self._clock(), micro_time(self._wall_clock())
        url = lease_path(self.namespace, self.name)
        current = await self.kube.get(url)
        if current is None:
            body = {
                "apiVersion": LEASE_API_VERSION,
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._record(None, now),
            }
            try:
                # common/kube.py's create() knows only the kinds the operator reconciles, and it has no PUT.
                written = await self.kube._json("POST", lease_path(self.namespace), json=body)
            except KubeError as exc:
                if exc.code == 409:  # another candidate created it first
                    return False
                raise
            return self._won(written, started)
        spec, seen = current.get("spec") or {}, self._clock()  # after the read: no earlier than its write
        self._observe(spec, seen)
        holder = spec.get("holderIdentity") or ""
        if holder and holder != self.identity and not self._expired(spec, seen):
            return False
        body = copy.deepcopy(current)  # keeps metadata.resourceVersion: a stale one answers 409
        body["spec"] = self._record(spec, now)
        try:
            written = await self.kube._json("PUT", url, json=body)
        except KubeError as exc:
            if exc.code == 409:  # someone wrote it since we read it: look again next time
                return False
            raise
        return self._won(written, started)

    def _record(self, old: dict | None, now: str) -> dict:
        """The spec we write: a renewal keeps acquireTime; a change of holder moves it and counts a transition."""
        if old is None:  # a new Lease
            acquired, transitions = now, 0
        elif old.get("holderIdentity") == self.identity:
            acquired, transitions = old.get("acquireTime") or now, old.get("leaseTransitions") or 0
        else:
            acquired, transitions = now, (old.get("leaseTransitions") or 0) + 1
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_duration,
            "acquireTime": acquired,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _observe(self, spec: dict, now: float) -> None:
        if spec != self._observed:
            self._observed, self._observed_at = copy.deepcopy(spec), now
        self.holder = spec.get("holderIdentity") or None

    def _expired(self, spec: dict, now: float) -> bool:
        duration = spec.get("leaseDurationSeconds") or self.lease_duration
        return now >= self._observed_at + duration

    def _won(self, written: dict, started: float) -> bool:
        self._observe(written.get("spec") or {}, self._clock())
        self._renewed_at = started  # a standby sees this write after its read returns: later than this
        return True

    # --- loops ---------------------------------------------------------------------------------------

    async def acquire(self) -> None:
        """Try every retry_interval until this candidate leads. Logs standby once per holder it waits on."""
        waiting_on: str | None = "?"
        while True:
            try:
                if await asyncio.wait_for(self.try_acquire_or_renew(), timeout=self.renew_deadline):
                    break
                if self.holder != waiting_on:
                    waiting_on = self.holder
                    log.info("standby: the lease is held by another replica",
                             extra={**self._fields(), "holder": self.holder})  # fmt: skip
            except (KubeError, TimeoutError) as exc:
                log.warning("lease attempt failed; retrying", extra={**self._fields(), "error": str(exc)})
            self.role = "standby"
            await asyncio.sleep(self.retry_interval)
        self.role = "leader"
        log.info("acquired the lease: this replica leads",
                 extra={**self._fields(), "transitions": (self._observed or {}).get("leaseTransitions")})  # fmt: skip

    async def hold(self) -> None:
        """Renew every retry_interval while leading; raise LeadershipLost when that stops being true.

        Never returns normally: cancel it to stop renewing (then call release())."""
        if self.role != "leader":
            raise RuntimeError("hold() before acquire()")
        while True:
            deadline = self._renewed_at + self.renew_deadline
            await asyncio.sleep(max(0.0, min(self.retry_interval, deadline - self._clock())))
            remaining, error = deadline - self._clock(), ""
            if remaining > 0:
                try:
                    if await asyncio.wait_for(self.try_acquire_or_renew(), timeout=remaining):
                        continue
                    error = f"the lease is held by {self.holder}" if self.holder != self.identity else "conflict"
                except (KubeError, TimeoutError) as exc:
                    error = str(exc) or type(exc).__name__
                if self.holder not in (None, self.identity):
                    self._lost(f"the lease is held by {self.holder}")
                log.warning("lease renewal failed; retrying",
                            extra={**self._fields(), "error": error, "seconds_left": round(remaining, 2)})  # fmt: skip
            if self._clock() >= deadline:
                self._lost(f"no renewal for {self.renew_deadline:g} s (last error: {error or 'none'})")

    def _lost(self, why: str) -> None:
        self.role = "lost"
        log.error("lost the lease: this replica stops acting", extra={**self._fields(), "reason": why})
        raise LeadershipLost(f"lost lease {self.lease}: {why}")

    async def release(self) -> bool:
        """Give the Lease up (no holder, as client-go's ReleaseOnCancel does), so that a standby takes
        over at its next attempt instead of after lease_duration. Only a Lease we still hold is touched."""
        if self.role != "leader":
            return False
        url = lease_path(self.namespace, self.name)
        try:
            current = await self.kube.get(url)
            spec = (current or {}).get("spec") or {}
            if current is None or spec.get("holderIdentity") != self.identity:
                return False
            body = copy.deepcopy(current)
            now = micro_time(self._wall_clock())
            body["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": now}
            await self.kube._json("PUT", url, json=body)
        except (KubeError, TimeoutError) as exc:
            log.warning("could not release the lease; it expires by itself",
                        extra={**self._fields(), "error": str(exc)})  # fmt: skip
            return False
        self.role = "released"
        log.info("released the lease", extra=self._fields())
        return True
