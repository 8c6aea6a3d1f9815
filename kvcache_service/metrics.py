"""Prometheus metrics of the KV cache service (prefix `kvharbor_kvcache_`), in a registry of its own.

Lookup counters and latencies are recorded as lookups happen; index, intake, store and reuse
figures come from the snapshot that /metrics gathers right before rendering.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvharbor.kvcache_service.reuse_stats import FIELDS as REUSE_FIELDS

LOOKUP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _SnapshotCollector:
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self):
        snap = self.snapshot
        if not snap:
            return
        intake = snap["intake"]
        yield _counter("events_applied", "KV events applied to the index", intake["applied"])
        yield _counter("events_duplicate", "KV events skipped as already applied", intake["duplicates"])
        malformed = CounterMetricFamily(
            "kvharbor_kvcache_events_malformed", "KV events skipped as malformed", labels=["reason"]
        )
        for reason, n in intake["malformed"].items():
            malformed.add_metric([reason], n)
        yield malformed
        yield _counter("instances_swept", "Instances dropped after their lease expired", intake["swept"])
        old = intake["old_layout_removed"]
        yield _counter("old_layout_keys_removed", "Keys of an older index layout removed (an upgrade left)", old)
        leader = int(intake["leader"])
        yield _gauge("intake_leader", "1 while this replica sweeps lapsed leases (the first member)", leader)
        yield _gauge("intake_streams", "Engine event streams this replica consumes", len(intake["streams"]))
        yield _gauge("intake_members", "Live intake replicas this replica sees", intake["members"])
        yield _counter("intake_handoffs", "Streams this replica gave up or lost to another", intake["handoffs"])
        yield _gauge("redis_up", "1 while Redis answers", int(snap["redis_up"]))
        index = snap.get("index")
        if index is not None:
            yield _gauge("instances", "Instances in the index", index["instances"])
            yield _gauge("instances_alive", "Instances with a live lease", index["alive"])
            yield _gauge("index_blocks", "Device-tier (block, instance) entries in the index", index["blocks"])
        store = snap.get("store")
        if store is not None:
            yield _gauge("store_bytes", "Bytes held by the shared block store", store["bytes"])
            yield _gauge("store_cap_bytes", "Byte cap of the shared block store", store["cap_bytes"])
            yield _gauge("store_blocks", "Blocks held by the shared block store", store["blocks"])
            yield _counter("store_evictions", "Blocks evicted from the shared block store (LRU)", store["evictions"])
        reuse = snap.get("reuse")
        if reuse is not None:
            family = CounterMetricFamily(
                "kvharbor_kvcache_reuse", "Prefix reuse reported by engines", labels=["model", "kind"]
            )
            for model, values in sorted(reuse.items()):
                for name in REUSE_FIELDS:
                    family.add_metric([model, name], values[name])
            yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kvharbor_kvcache_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"kvharbor_kvcache_{name}", doc, value=value)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.lookups = Counter(
            "kvharbor_kvcache_lookups", "Prefix lookups answered, by outcome", ["outcome"], registry=self.registry
        )
        self.lookup_seconds = Histogram(
            "kvharbor_kvcache_lookup_seconds", "Time to answer a lookup", buckets=LOOKUP_BUCKETS, registry=self.registry
        )
        self.requests = Counter(
            "kvharbor_kvcache_http_requests",
            "HTTP requests by path and status",
            ["path", "status"],
            registry=self.registry,
        )
        self._snapshot = _SnapshotCollector()
        self.registry.register(self._snapshot)

    def render(self, snapshot: dict[str, Any]) -> bytes:
        self._snapshot.snapshot = snapshot
        return generate_latest(self.registry)
