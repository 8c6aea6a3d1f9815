"""Prometheus metrics of one engine server (prefix `kvharbor_`), in a registry of its own.

Request counters and latency histograms are fed by the API server as requests finish; the load
gauges (running, waiting, KV blocks, prefix-cache hit rate, measured speed) and the engine core's
counters (one core_io.CoreStats, with its CounterBoard: KV events, the shared block store) are read
from the latest snapshot the core sent, at scrape time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvharbor.common.load_report import LoadReport
from kvharbor.engine.core_io import CoreStats
from kvharbor.engine.counter_board import BOARD

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
Snapshot = Callable[[], tuple[LoadReport, CoreStats]]


class _LoadCollector:
    def __init__(self, snapshot: Snapshot, labels: dict[str, str]) -> None:
        self._snapshot = snapshot
        self._labels = labels

    def collect(self):
        load, stats = self._snapshot()
        board = stats.board
        names, values = list(self._labels), list(self._labels.values())
        for name, (doc, label) in BOARD.items():
            c = CounterMetricFamily(f"kvharbor_{name}", doc, labels=names + ([label] if label else []))
            for key, value in (board.get(name) or ({} if label else {"": 0})).items():
                c.add_metric(values + ([key] if label else []), value)
            yield c

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"kvharbor_{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kvharbor_{name}", doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("requests_running", "Requests in the running batch", load.running)
        yield gauge("requests_waiting", "Requests queued for admission", load.waiting)
        yield gauge(
            "waiting_prefill_tokens",
            "Prompt tokens not computed yet (queued or mid-prefill)",
            load.waiting_prefill_tokens,
        )
        yield gauge("kv_blocks_total", "KV blocks in the pool", load.kv_blocks_total)
        yield gauge("kv_blocks_free", "KV blocks with no user (cached or not)", load.kv_blocks_free)
        yield gauge("kv_blocks_cached", "KV blocks reusable by prefix", load.kv_blocks_cached)
        yield gauge("prefill_tokens_per_second", "Measured prefill speed (EWMA)", load.prefill_tokens_per_s)
        yield gauge("decode_step_seconds", "Measured decode step time (EWMA)", load.decode_step_ms / 1000)
        yield gauge("decode_batch", "Sequences in the measured decode steps (EWMA)", load.decode_batch)
        yield gauge(
            "decode_step_seconds_per_sequence", "How a decode step grows per sequence (fitted)",
            load.decode_ms_per_seq / 1000,
        )  # fmt: skip
        yield gauge(
            "decode_step_seconds_per_context_token", "How a decode step grows per context token (fitted)",
            load.decode_us_per_context_token / 1e6,
        )  # fmt: skip
        yield gauge("kv_block_size_tokens", "Tokens per KV block (what prefix hashes are cut by)", load.block_size)
        yield gauge("weight_bytes", "The model's weights as held (quantized at their own size)", load.weight_bytes)
        yield gauge("kv_bytes_per_token", "KV bytes one token takes in the pool", load.kv_bytes_per_token)
        role = GaugeMetricFamily("kvharbor_engine_role", "This engine's P/D role (1 for the one it has)",
                                 labels=[*names, "role"])  # fmt: skip
        role.add_metric([*values, load.role], 1)
        yield role
        yield gauge("kv_pinned_blocks", "P/D: KV blocks held for decode engines that have not confirmed",
                    load.kv_pinned_blocks)  # fmt: skip
        yield gauge("kv_transfer_bytes_per_second", "P/D: measured pull rate from prefill engines (EWMA)",
                    load.kv_transfer_bytes_per_s)  # fmt: skip
        yield from self._lora(load, stats, names, values, gauge, counter)
        queries, hits = stats.prefix_queries, stats.prefix_hits
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
        yield gauge(
            "prefix_cache_hit_rate", "Share of looked-up prompt tokens found cached", hits / queries if queries else 0.0
        )
        yield counter("requests_aborted", "Requests cancelled in flight (client gone, drain timeout)", stats.aborted)
        checks, proposed, accepted = stats.spec_verifications, stats.spec_proposed, stats.spec_accepted
        yield counter("step_seconds", "Time the engine spent in steps", stats.step_seconds)
        yield counter("structured_mask_seconds", "Of the steps' time, masking structured outputs' logits",
                      stats.mask_seconds)  # fmt: skip
        yield gauge("structured_mask_share", "Share of the steps' time spent masking structured outputs",
                    stats.mask_seconds / stats.step_seconds if stats.step_seconds else 0.0)  # fmt: skip
        yield counter("spec_verifications", "Speculative chunks the target verified", checks)
        yield counter("spec_proposed_tokens", "Speculated tokens the target scored", proposed)
        yield counter("spec_accepted_tokens", "Speculated tokens accepted", accepted)
        rate = accepted / proposed if proposed else 0.0
        yield gauge("spec_acceptance_rate", "Accepted / proposed speculated tokens", rate)
        yield gauge(
            "spec_mean_accepted_length",
            "Accepted speculated tokens per verification (the target adds one of its own)",
            accepted / checks if checks else 0.0,
        )

    @staticmethod
    def _lora(load, stats, names, values, gauge, counter):
        if not load.lora_slots:
            return
        yield gauge("lora_slots", "LoRA adapters one step can run (--max-loras)", load.lora_slots)
        yield gauge("lora_bytes", "Memory the LoRA slots and loaded adapters take", load.lora_bytes)
        loaded = GaugeMetricFamily("kvharbor_lora_adapter_loaded", "A loaded LoRA adapter (active: holds a slot)",
                                   labels=[*names, "adapter", "active"])  # fmt: skip
        for name in sorted(load.lora_adapters):
            loaded.add_metric([*values, name, str(name in load.lora_active).lower()], 1)
        yield loaded
        yield counter("lora_swaps", "Adapters copied into a slot", stats.lora_swaps)
        yield counter("lora_swap_seconds", "Time spent copying adapters into slots", stats.lora_swap_seconds)


class ServerMetrics:
    def __init__(self, snapshot: Snapshot, model: str, instance: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model, "instance": instance}
        self.requests = Counter(
            "kvharbor_requests", "Finished HTTP requests", ["endpoint", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "kvharbor_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kvharbor_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvharbor_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Histogram(
            "kvharbor_request_prompt_tokens", "Prompt tokens per request", buckets=TOKEN_BUCKETS, registry=self.registry
        )
        self.ignored_fields = Counter(
            "kvharbor_ignored_fields",
            "Top-level request fields no request model takes: dropped, named in X-Kvharbor-Ignored-Fields",
            registry=self.registry,
        )
        self.lora_requests = Counter(
            "kvharbor_lora_requests", "Requests admitted per LoRA adapter", ["adapter"], registry=self.registry
        )
        self.output_tokens = Histogram(
            "kvharbor_request_generation_tokens",
            "Generated tokens per request",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_LoadCollector(snapshot, labels))

    def observe_request(self, arrival: float, token_times: list[float], prompt_tokens: int) -> None:
        """Record one finished generation: `token_times` are when each output token appeared."""
        self.prompt_tokens.observe(prompt_tokens)
        self.output_tokens.observe(len(token_times))
        if token_times:
            self.ttft.observe(token_times[0] - arrival)
            self.e2e.observe(token_times[-1] - arrival)
            for a, b in itertools.pairwise(token_times):
                self.itl.observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)
