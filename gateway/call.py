"""One tenant call on its way through the gateway, and what it counts in the metrics.

The front matter (gateway/app.py) makes a `Call`; the flow (gateway/flow.py) fills in its blocks,
its P/D hand-off and its route, and counts it once: rejected, routed, finished.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvharbor.common.block_hash import DEFAULT_BLOCK_SIZE
from kvharbor.common.openai_api import GATEWAY_ID_SUFFIX, MAX_REQUEST_ID, ChatCompletionRequest, CompletionRequest
from kvharbor.common.tokenizer import Tokenizer
from kvharbor.gateway.catalog import Resolved
from kvharbor.gateway.metrics import GatewayMetrics, adapter_label
from kvharbor.gateway.predict import adapter_slot
from kvharbor.gateway.relay import StreamStats
from kvharbor.gateway.router import Route
from kvharbor.gateway.tenants import Tenant

log = logging.getLogger("kvharbor.gateway.api")


@dataclass
class ModelEntry:
    name: str
    tokenizer: Tokenizer | None
    slo_ttft_s: float
    slo_itl_s: float
    block_size: int | None = None  # pinned by the models file; None: the engines' (router.block_size_for)
    mismatch: str | None = None  # the block-size disagreement last logged, if any
    task: str = "generate"  # generate | embed, as the models file says (gateway/embeddings.py)


@dataclass
class Call:
    """One request on its way through the gateway."""

    kind: str  # chat | completion
    tenant: Tenant
    model: ModelEntry
    body: ChatCompletionRequest | CompletionRequest
    raw: dict
    prompts: list[list[int]]
    rid: str
    resolved: Resolved  # its base model and LoRA adapter
    arrival: float = field(default_factory=time.monotonic)
    slot: str = field(default_factory=lambda: uuid.uuid4().hex)  # this admission's concurrency slot
    span: Any = None
    block_size: int = DEFAULT_BLOCK_SIZE  # what its prompt's blocks are cut by (set on admission)
    hashes: list[bytes] = field(default_factory=list)  # its prompt's block hashes (set on admission)
    transfer: dict | None = None  # P/D: the prefill engine's hand-off, for the decode engine
    ignored: dict[str, str] = field(default_factory=dict)  # the header naming fields it carried that were ignored
    # A stored conversation's last turn: {"instance", "blocks", "last"} (gateway/responses.py):
    # where it ran, and its prompt's full blocks, of which "last" is the final hash.
    affinity: dict | None = None
    served_by: str | None = None  # the instance id of the engine that answered (set by the flow)

    def known_held(self) -> tuple[str, int] | None:
        """(instance, blocks) of this prompt that the engine of `affinity` holds: its last turn's
        prompt blocks, when they are a prefix of this prompt's (the hashes chain: one equal hash
        at the same place means the whole prefix is equal). None otherwise."""
        a = self.affinity
        if not a or not a.get("instance") or not 0 < a["blocks"] <= len(self.hashes):
            return None
        return (a["instance"], a["blocks"]) if self.hashes[a["blocks"] - 1].hex() == a["last"] else None

    @property
    def adapter(self) -> str | None:
        """Its LoRA adapter's name; None for the base model."""
        return self.resolved.adapter

    @property
    def adapter_label(self) -> str:
        return adapter_label(self.resolved.adapter)

    @property
    def prompt_tokens(self) -> int:
        """The first prompt's length: what routing, P/D and migration reason about."""
        return len(self.prompts[0])

    @property
    def weight(self) -> int:
        """Its prompts: each takes one of the tenant's concurrency slots (gateway/limits.py)."""
        return len(self.prompts)

    @property
    def max_tokens(self) -> int | None:
        """Its output cap: the client's, else the tenant's (the front matter puts it in `raw`)."""
        return self.body.max_new_tokens() or self.raw.get("max_tokens")

    @property
    def one_sequence(self) -> bool:
        """One prompt and one sample: what P/D and stream migration can carry."""
        return len(self.prompts) == 1 and (self.body.n or 1) == 1

    @property
    def calls_tools(self) -> bool:
        """A chat that may answer with tool calls (whose streamed deltas cannot be continued)."""
        return self.kind == "chat" and self.body.tool_mode() != "none"

    @property
    def pd_supported(self) -> bool:
        """P/D carries one prompt, one sample and no logprobs."""
        return self.one_sequence and self.body.num_logprobs() is None

    @property
    def engine_rid(self) -> str:
        """Unique at the engine even when clients reuse ids (theirs stays in x-request-id and logs),
        and within the engine's request-id limit with a migration's suffix on it."""
        return f"{self.rid[: MAX_REQUEST_ID - GATEWAY_ID_SUFFIX]}.{self.slot[:8]}"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"


def count_rejected(m: GatewayMetrics, call: Call, reason: str) -> None:
    m.rejections.labels(call.tenant.name, reason).inc()
    m.requests.labels(call.tenant.name, call.model.name, "rejected").inc()
    m.adapter_requests.labels(call.model.name, call.adapter_label, "rejected").inc()
    log.info("rejected", extra={"tenant": call.tenant.name, "reason": reason})


def count_route(m: GatewayMetrics, call: Call, route: Route) -> None:
    """The route the request takes, once P/D has had its say (a short output served whole by a
    prefill engine counts there, as short_output), before it is sent: the adapter slot is the
    one it finds."""
    model = call.model.name
    m.routes.labels(model, route.reason).inc()
    m.prompt_blocks.labels(model).inc(route.prompt_blocks)
    m.matched_blocks.labels(model).inc(route.matched_blocks)
    if call.adapter:
        m.adapter_routes.labels(model, call.adapter, adapter_slot(route.engine, call.adapter).value).inc()


def count_finished(m: GatewayMetrics, call: Call, usage: dict, stats: StreamStats | None) -> None:
    """Tokens, outcome, TTFT/ITL and goodput for a call that got an answer (`stats`: a stream's)."""
    tenant, model, adapter = call.tenant.name, call.model.name, call.adapter_label
    completion = int(usage.get("completion_tokens", 0))
    m.tokens.labels(tenant, "completion").inc(completion)
    m.adapter_tokens.labels(model, adapter, "completion").inc(completion)
    error = stats.error if stats else None
    m.requests.labels(tenant, model, "error" if error else "ok").inc()
    m.adapter_requests.labels(model, adapter, "error" if error else "ok").inc()
    now = time.monotonic()
    if stats is not None and stats.first_token is not None:
        good = _count_stream_times(m, call, stats) and not error
    else:
        good = stats is None and (now - call.arrival) <= call.model.slo_ttft_s + completion * call.model.slo_itl_s
    if good:
        m.goodput.labels(tenant, model).inc()
    log.info("finished", extra={
        "tenant": tenant, "model": model, "adapter": call.adapter, "completion_tokens": completion,
        "e2e_ms": round((now - call.arrival) * 1000, 1), "error": error})  # fmt: skip


def _count_stream_times(m: GatewayMetrics, call: Call, stats: StreamStats) -> bool:
    """Observes a stream's TTFT and gaps; whether they met the model's SLOs (ITL at p95)."""
    tenant, model, adapter = call.tenant.name, call.model.name, call.adapter_label
    ttft = stats.first_token - call.arrival
    m.ttft.labels(tenant).observe(ttft)
    m.adapter_ttft.labels(model, adapter).observe(ttft)
    gaps = [b - a for a, b in zip([stats.first_token, *stats.chunk_times], stats.chunk_times, strict=False)]
    adapter_itl = m.adapter_itl.labels(model, adapter)
    for gap in gaps:
        m.itl.labels(tenant).observe(gap)
        adapter_itl.observe(gap)
    itl_p95 = sorted(gaps)[int(0.95 * (len(gaps) - 1))] if gaps else 0.0
    return ttft <= call.model.slo_ttft_s and itl_p95 <= call.model.slo_itl_s
