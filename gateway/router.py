"""Which engine gets a request.

- `prefix` (default): for each routable engine, score = prefix_weight x matched/prompt blocks
  (from the KV index) + kv_weight x free KV share + queue_weight x (1 - queue / longest queue).
  When the queues differ by more than `imbalance_threshold`, or the index cannot answer in
  time, load alone decides. When the chosen engine holds less of the prefix than another, the
  request carries `kv_prefix_source=shared` so the engine pulls the rest from the block store.
  Then predictions decide (`faster_elsewhere`): another engine predicted better on TTFT (with
  its cache miss counted) and no worse on ITL or within the ITL SLO, or better on ITL and no
  worse on TTFT, takes the request instead.
  LoRA (the request names an adapter; every candidate serves it): the predicted TTFT adds the
  adapter's slot cost (predict.py's `adapter_cost_s`: 0 where it is active, one LORA_SWAP_S into
  a free slot, two where it must evict another), so engines are preferred active > free slot >
  swap, traded in seconds against their queues and cache misses. Requests this gateway has open on
  an engine make their adapter active there, so a burst for one adapter follows its first request
  instead of swapping it into every engine. When load alone decides, the slot breaks queue ties.
- `least_loaded`: the shortest queue, then the most free KV.
- `round_robin`: in turn.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvharbor.common.block_hash import DEFAULT_BLOCK_SIZE, BlockHash
from kvharbor.gateway.config import RoutingConfig
from kvharbor.gateway.engines import Engine
from kvharbor.gateway.predict import adapter_cost_s, predict
from kvharbor.kvcache_service.index import IndexUnavailable

log = logging.getLogger("kvharbor.gateway.router")


@dataclass(frozen=True)
class Route:
    engine: Engine
    reason: str  # prefix | load | imbalance | index_unavailable | latency | slo | least_loaded | round_robin
    matched_blocks: int = 0  # of the prompt, held by the chosen engine
    prompt_blocks: int = 0
    held: dict[str, int] = field(default_factory=dict)  # engine url -> blocks of the prompt it holds
    kv_formats: dict[str, str] = field(default_factory=dict)  # engine url -> its /load kv_format

    def kv_prefix_source(self, engine: Engine) -> str | None:
        """What the request tells `engine` (this route's, or a retry's): "shared" when another
        candidate whose blocks it can read (the same kv_format: layout, KV dtype, weights) holds
        more of the prefix, so it pulls those blocks instead of recomputing them. A holder of
        another format wrote blocks `engine` would refuse: the pull could only miss."""
        mine = self.kv_formats.get(engine.url, "")
        best = max((n for url, n in self.held.items() if self.kv_formats.get(url, "") == mine), default=0)
        return "shared" if self.held.get(engine.url, 0) < best else None

    def to(self, engine: Engine, reason: str) -> Route:
        """The same request sent to another engine."""
        return replace(self, engine=engine, reason=reason, matched_blocks=self.held.get(engine.url, 0))


class Router:
    def __init__(self, config: RoutingConfig, index=None) -> None:
        self.config = config
        self.index = index  # kvcache_service Index (RedisIndex), or None: no prefix information
        self._turns: dict[str, itertools.count] = {}

    async def matches(
        self, model: str, hashes: Sequence[BlockHash], engines: Sequence[Engine]
    ) -> dict[str, int] | None:
        """Blocks each engine holds, by instance id; None when the index cannot answer."""
        if self.index is None or not hashes:
            return {} if self.index is not None else None
        ids = [e.instance_id for e in engines if e.instance_id]
        try:
            return await asyncio.wait_for(self.index.lookup(model, hashes, ids), self.config.index_timeout)
        except (IndexUnavailable, TimeoutError) as exc:
            log.debug("KV index unavailable; routing by load", extra={"error": repr(exc)})
            return None

    async def choose(
        self,
        model: str,
        engines: Sequence[Engine],
        hashes: Sequence[BlockHash],
        prompt_tokens: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
        slo_itl_s: float = 0.0,
        adapter: str | None = None,
        known: tuple[str, int] | None = None,
    ) -> Route | None:
        """The engine for a request among `engines` (for a LoRA `adapter`, by name: only engines
        that serve it); `model` is the base model, whose KV index the hashes are looked up in.
        `known`: (instance id, blocks) the gateway knows that engine holds of this prompt (a
        stored conversation's last turn ran there), whatever the index says yet."""
        if not engines:
            return None
        strategy = self.config.routing
        if strategy == "round_robin":
            turn = next(self._turns.setdefault(model, itertools.count()))
            return Route(engines[turn % len(engines)], "round_robin", prompt_blocks=len(hashes))
        if strategy == "least_loaded":
            return Route(_least_loaded(engines), "least_loaded", prompt_blocks=len(hashes))
        matches = await self.matches(model, hashes, engines)
        if known is not None:  # the index may not have that turn's blocks yet: its KV events are in flight
            matches = dict(matches or {})
            matches[known[0]] = max(matches.get(known[0], 0), min(known[1], len(hashes)))
        route = self.by_prefix(engines, hashes, matches, adapter)
        return faster_elsewhere(route, engines, prompt_tokens, block_size, slo_itl_s, adapter)

    def by_prefix(
        self,
        engines: Sequence[Engine],
        hashes: Sequence[BlockHash],
        matches: dict[str, int] | None,
        adapter: str | None = None,
    ) -> Route:
        blocks = len(hashes)
        held = {e.url: (matches or {}).get(e.instance_id or "", 0) for e in engines}
        queues = [e.queue for e in engines]
        if matches is None:
            reason, chosen = "index_unavailable", _least_loaded(engines, adapter)
        elif max(queues) - min(queues) > self.config.imbalance_threshold:
            reason, chosen = "imbalance", _least_loaded(engines, adapter)
        else:
            chosen = max(engines, key=lambda e: (self._score(e, held[e.url], blocks, max(queues)), -e.queue))
            reason = "prefix" if held[chosen.url] else "load"
        return Route(chosen, reason, held[chosen.url], blocks, held, {e.url: e.load.kv_format for e in engines})

    def _score(self, engine: Engine, held: int, blocks: int, longest_queue: int) -> float:
        c = self.config
        prefix = held / blocks if blocks else 0.0
        queue = 1.0 - engine.queue / longest_queue if longest_queue else 1.0
        return c.prefix_weight * prefix + c.kv_weight * engine.kv_free + c.queue_weight * queue


def faster_elsewhere(
    route: Route,
    engines: Sequence[Engine],
    prompt_tokens: int,
    block_size: int,
    slo_itl_s: float,
    adapter: str | None = None,
) -> Route:
    """The route, or the engine predicted faster for this request (reason "latency"): better on
    TTFT (a cache miss counted in its prefill, and for a LoRA `adapter` its slot cost) with an ITL
    no worse or within the SLO, or better on ITL with a TTFT no worse (gateway/predict.py's better_than).
    The score's prefix term is bounded, so on its own it keeps sending a burst of one prefix to its
    holder; predictions count what this gateway sent since the last poll, so the burst spreads as
    soon as the holder's queue costs more than the other's miss."""
    if route.reason not in ("prefix", "load"):
        return route  # imbalance and a silent index route by load alone
    predicted = {e.url: predict(e, prompt_tokens, route.held.get(e.url, 0), block_size, adapter) for e in engines}
    mine = predicted[route.engine.url]
    better = [e for e in engines if predicted[e.url].better_than(mine, slo_itl_s)]
    if not better:
        return route
    best = min(better, key=lambda e: (predicted[e.url].ttft_s, predicted[e.url].itl_s))
    return route.to(best, "latency")


def block_size_for(configured: int | None, engines: Sequence[Engine]) -> tuple[int, str | None]:
    """The block size to hash a model's prompts with, and what is wrong, if anything. The engines'
    /load says what they cut blocks by; their KV events, and so the index, use that. A models file
    that pins another size, or engines that disagree, is a mismatch: every lookup on the other
    size misses, so it is reported, and the engines' (most common) size is used."""
    reported = collections.Counter(e.load.block_size for e in engines if e.polled and e.load.block_size)
    if not reported:
        return configured or DEFAULT_BLOCK_SIZE, None
    size = reported.most_common(1)[0][0]
    if len(reported) > 1:
        return size, f"engines report different block sizes {sorted(reported)}: hashing with {size}"
    if configured is not None and configured != size:
        return size, f"the models file pins block_size {configured} but the engines use {size}: hashing with {size}"
    return size, None


def _least_loaded(engines: Sequence[Engine], adapter: str | None = None) -> Engine:
    return min(engines, key=lambda e: (e.queue, adapter_cost_s(e, adapter), -e.kv_free))
