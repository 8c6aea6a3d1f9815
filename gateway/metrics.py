"""Prometheus metrics of the gateway (prefix `kvharbor_gateway_`), in a registry of its own.

The `kvharbor_gateway_adapter_*` series count per LoRA adapter: `model` is the base model and
`adapter` the adapter's name, BASE_ADAPTER ("") for requests on the base model itself.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BASE_ADAPTER = ""  # the `adapter` label of requests on the base model


def adapter_label(adapter: str | None) -> str:
    return adapter or BASE_ADAPTER


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests(self.registry)
        self._routing(self.registry)
        self._adapters(self.registry)
        self._responses(self.registry)

    def _requests(self, r: CollectorRegistry) -> None:
        """Per tenant: requests, tokens, refusals, streams, latency, goodput."""
        self.requests = Counter(
            "kvharbor_gateway_requests",
            "Requests by tenant, model and status",
            ["tenant", "model", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "kvharbor_gateway_tokens", "Tokens by tenant and kind (prompt, completion)", ["tenant", "kind"], registry=r
        )
        self.refused = Counter(
            "kvharbor_gateway_requests_refused",
            "Requests an engine refused as their own fault (a 4xx: never retried elsewhere, never counted "
            "against the engine), by the engine's reason",
            ["reason"],
            registry=r,
        )
        self.ignored_fields = Counter(
            "kvharbor_gateway_ignored_fields",
            "Top-level request fields no request model takes: dropped, named in X-Kvharbor-Ignored-Fields",
            registry=r,
        )
        self.rejections = Counter(
            "kvharbor_gateway_rejections", "Refused requests by tenant and reason", ["tenant", "reason"], registry=r
        )
        self.stream_migrations = Counter(
            "kvharbor_gateway_stream_migrations",
            "Streams moved to another engine when theirs failed mid-way (moved), that could not move (failed), "
            "or that the gateway ended because the engine had sent every token allowed (finished)",
            ["model", "result"],
            registry=r,
        )
        self.stream_timeouts = Counter(
            "kvharbor_gateway_stream_timeouts",
            "Streams ended by their deadline or an idle timeout (the engine's request aborted)",
            ["model", "kind"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "kvharbor_gateway_queue_seconds",
            "Time waiting for admission",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvharbor_gateway_time_to_first_token_seconds",
            "Arrival to first token",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kvharbor_gateway_inter_token_latency_seconds",
            "Between streamed chunks",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.goodput = Counter(
            "kvharbor_gateway_goodput_requests",
            "Requests that met their TTFT and ITL SLOs",
            ["tenant", "model"],
            registry=r,
        )

    def _routing(self, r: CollectorRegistry) -> None:
        """Per model: routes, P/D decisions, prefix matches, retries, the engines and the queue."""
        self.routes = Counter(
            "kvharbor_gateway_routing_decisions", "Routing decisions by reason", ["model", "reason"], registry=r
        )
        self.pd_decisions = Counter(
            "kvharbor_gateway_pd_decisions",
            "P/D: where each request's prefill ran, by reason (disaggregated, or why colocated)",
            ["model", "reason"],
            registry=r,
        )
        self.prompt_blocks = Counter(
            "kvharbor_gateway_prompt_blocks", "Full prompt blocks of routed requests", ["model"], registry=r
        )
        self.matched_blocks = Counter(
            "kvharbor_gateway_matched_blocks", "Of those, held by the chosen engine", ["model"], registry=r
        )
        self.retries = Counter(
            "kvharbor_gateway_retries",
            "Requests moved to another engine before their first token",
            ["model"],
            registry=r,
        )
        self.block_size_mismatches = Counter(
            "kvharbor_gateway_block_size_mismatches",
            "Requests hashed while the engines (or the models file) disagreed on the KV block size",
            ["model"],
            registry=r,
        )
        self.engines_up = Gauge("kvharbor_gateway_engines_routable", "Engines in rotation", ["model"], registry=r)
        self.queued = Gauge("kvharbor_gateway_queue_length", "Requests waiting for admission", registry=r)
        self.prefix_hit_ratio = Gauge(
            "kvharbor_gateway_prefix_hit_ratio",
            "Matched / prompt blocks of routed requests, so far",
            ["model"],
            registry=r,
        )

    def _responses(self, r: CollectorRegistry) -> None:
        """The Responses API's store (gateway/response_store.py)."""
        self.responses_evicted = Counter(
            "kvharbor_gateway_responses_evicted",
            "Stored responses dropped: past their TTL (counted at the tenant's next write), over the tenant's byte "
            "budget, or larger than the whole budget (too_large)",
            ["reason"],
            registry=r,
        )
        self.responses_missed = Counter(
            "kvharbor_gateway_responses_missed",
            "Reads of a stored response that was not there: evicted (the 404 says why) or unknown (never stored, "
            "past its TTL, deleted, or another tenant's)",
            ["reason"],
            registry=r,
        )
        self.responses_store_failures = Counter(
            "kvharbor_gateway_responses_store_failures",
            "Response store calls that failed (Redis away): a 503, or a stream that ends in response.failed",
            registry=r,
        )

    def _adapters(self, r: CollectorRegistry) -> None:
        """Per base model and LoRA adapter ("": the base model)."""
        self.adapter_requests = Counter(
            "kvharbor_gateway_adapter_requests",
            'Requests by base model, LoRA adapter ("": the base model) and status',
            ["model", "adapter", "status"],
            registry=r,
        )
        self.adapter_tokens = Counter(
            "kvharbor_gateway_adapter_tokens",
            "Tokens by base model, LoRA adapter and kind (prompt, completion)",
            ["model", "adapter", "kind"],
            registry=r,
        )
        self.adapter_ttft = Histogram(
            "kvharbor_gateway_adapter_time_to_first_token_seconds",
            "Arrival to first token, by base model and LoRA adapter",
            ["model", "adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_itl = Histogram(
            "kvharbor_gateway_adapter_inter_token_latency_seconds",
            "Between streamed chunks, by base model and LoRA adapter",
            ["model", "adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_routes = Counter(
            "kvharbor_gateway_adapter_routes",
            "Adapter requests routed, by where the adapter stood on the chosen engine (active, free_slot, swap)",
            ["model", "adapter", "slot"],
            registry=r,
        )

    def render(self, models: list[str]) -> bytes:
        for model in models:
            prompt = self.prompt_blocks.labels(model)._value.get()
            matched = self.matched_blocks.labels(model)._value.get()
            self.prefix_hit_ratio.labels(model).set(matched / prompt if prompt else 0.0)
        return generate_latest(self.registry)
