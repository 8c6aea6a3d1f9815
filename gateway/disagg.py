"""Prefill/decode disaggregation, decided per request (gateway/README.md says how).

The router first picks the decode engine, by prefix affinity and load, among engines whose role
is `decode` or `both`. Then `decide` asks whether a `prefill` engine is worth it for this request:

- gain = the prefill seconds the decode engine is spared (its uncached prompt tokens over its
  measured prefill rate: the time its running streams would stall) less the seconds it spends
  pulling the KV (the blocks it lacks, over the transfer rate it measured; DEFAULT_TRANSFER_BPS
  before it has), or nothing to pull for a request served whole (below). Below `min_gain_s` P/D
  does not pay: short prompts, a warm cache. A prompt shorter than one block has nothing to hand
  over. Only hand-offs measure the rate, so a measure older than `transfer_trust_s` is trusted
  less (`pull_rate`): pulls behind a busy prefill engine measured as little as 0.6 MB/s (a 2.2 MB
  chat in 3.5 s; 100-250 MB/s otherwise) in one benchmark run, and a rate that low, trusted for
  good, keeps every later chat colocated, so nothing measures it again (a sweep kept 38 chats
  colocated after 2 hand-offs).
- the TTFT: P/D is refused only where it would miss the TTFT SLO that colocated serving meets
  (a short chat while the prefill engine works through a long document). Where both miss it (a
  long document), the prefill engine takes the prompt anyway: that is what keeps the decode
  engine's streams steady.
- a short output (reason `short_output`): when the prefill engine would decode the request's
  `max_tokens` in less time than the decode engine spends pulling its KV, the prefill engine
  serves the whole request and nothing is handed over. Moving a 2,048-token document's 94 MB of
  float32 KV to decode 4 tokens cost the decode engine's streams more than those 4 steps cost the
  prefill engine: the pull runs on the decode engine's own cores. The step is the prefill
  engine's measured one, else the decode engine's (the same model); with neither measured, or no
  `max_tokens`, the request is handed over as before. This rule takes the measured pull rate
  as it is, however old (see `decide`).

Colocated serving is the answer whenever there is no prefill engine (counted apart from a pool
that is configured but down), or the request is one P/D does not carry (n > 1, logprobs, several
prompts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvharbor.common.load_report import LoadReport
from kvharbor.gateway.engines import Engine
from kvharbor.gateway.predict import predict_ttft_s, uncached_tokens

# Loopback on these machines moves GB/s; a pod network less. Only until the first pull is measured.
DEFAULT_TRANSFER_BPS = 500e6


@dataclass(frozen=True)
class Decision:
    prefill: Engine | None  # None: prefill on the decode engine (colocated)
    # disaggregated | off | no_prefill_engine | prefill_down | unsupported | short_prompt | ttft | short_output;
    # after the prefill call (gateway/pd_flow.py): prefill_failed | prefill_timeout
    reason: str
    gain_s: float = 0.0
    ttft_s: float = 0.0  # predicted TTFT of the chosen way
    transfer_s: float = 0.0  # the KV pull a hand-off would take, predicted (short_output: the one it avoids)
    whole: Engine | None = None  # short_output: the prefill engine that serves the whole request

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


@dataclass(frozen=True)
class Request:
    """What `decide` needs of one request."""

    prompt_tokens: int
    held: dict[str, int]  # engine url -> blocks of the prompt it holds (the router's lookup)
    block_size: int
    slo_ttft_s: float
    supported: bool = True  # n == 1, no logprobs, one prompt
    max_new_tokens: int | None = None  # the request's output limit; None: not given


def decode_candidates(engines: Sequence[Engine]) -> list[Engine]:
    """Engines that take whole requests: roles decode and both (prefill engines only when nothing else runs)."""
    takers = [e for e in engines if e.role != "prefill"]
    return takers or list(engines)


def prefill_pool(engines: Sequence[Engine]) -> list[Engine]:
    return [e for e in engines if e.role == "prefill"]


def decide(
    decode: Engine,
    prefill_engines: Sequence[Engine],
    request: Request,
    min_gain_s: float,
    configured: bool = True,
    transfer_trust_s: float = 0.0,
) -> Decision:
    """P/D or colocated for one request whose decode engine is `decode`. `prefill_engines`: the
    routable prefill engines; `configured`: whether any prefill engine exists at all (else the
    fallback counts as no_prefill_engine rather than prefill_down); `transfer_trust_s`: how long
    a measured pull rate is trusted as it is (0: for good)."""
    if not request.supported:
        return Decision(None, "unsupported")
    if not prefill_engines:
        return Decision(None, "prefill_down" if configured else "no_prefill_engine")
    bs = request.block_size
    here = uncached_tokens(request.prompt_tokens, request.held.get(decode.url, 0), bs)
    best, best_ttft = None, 0.0
    for engine in prefill_engines:
        uncached = uncached_tokens(request.prompt_tokens, request.held.get(engine.url, 0), bs)
        ttft = predict_ttft_s(engine.waiting_prefill_tokens, uncached, engine.prefill_tokens_per_s)
        if best is None or ttft < best_ttft:
            best, best_ttft = engine, ttft
    transfer = transfer_s(decode, request, pull_rate(decode.load, transfer_trust_s))
    # A decode engine that has only ever continued hand-offs has not measured a whole prefill:
    # the prefill engine's rate stands in (the same model, and in a pool the same hardware), for
    # the gain and for the TTFT colocated serving would have (unmeasured, that was 0: every long
    # prompt "met" the TTFT there, and the TTFT rule put documents on a fresh decode engine).
    # Neither measured yet: no evidence against the prefill pool the operator set up (predict.py's rule).
    rate = decode.prefill_tokens_per_s or best.prefill_tokens_per_s
    colocated = predict_ttft_s(decode.waiting_prefill_tokens, here, rate)
    # The short-output rule prices the pull at the rate as measured, however old. Priced at the
    # aged rate (which ends at DEFAULT_TRANSFER_BPS, above the ~150 MB/s a 94 MB pull measures
    # here), 4-token documents were handed over: 4-7x the KV moved, P/D's max gap 455-639 ms
    # against 224-373 (benchmarks/README.md). The cost: a rate measured very slow keeps serving
    # long outputs whole on the prefill engine, so nothing re-measures it through them.
    avoided = transfer_s(decode, request, pull_rate(decode.load))
    whole = decode_there_s(best, decode, request.max_new_tokens) <= avoided
    # Served whole, the request costs the decode engine nothing, so no transfer is set against the
    # prefill it is spared: a slow link (or a pessimistic measure of one) must not keep a long
    # prompt with a short output on the decode engine, stalling its streams for its whole prefill.
    gain = (here / rate if rate > 0 else math.inf) - (0.0 if whole else transfer)
    if request.prompt_tokens < request.block_size or gain < min_gain_s:
        return Decision(None, "short_prompt", gain, colocated, transfer)
    # Served whole, the request pays no transfer: its TTFT there is the prefill engine's own.
    ttft = best_ttft if whole else best_ttft + transfer
    if ttft > request.slo_ttft_s >= colocated:
        return Decision(None, "ttft", gain, colocated, transfer)
    if whole:
        return Decision(None, "short_output", gain, ttft, avoided, whole=best)
    return Decision(best, "disaggregated", gain, ttft, transfer)


def decode_there_s(prefill: Engine, decode: Engine, max_new_tokens: int | None) -> float:
    """Predicted seconds `prefill` takes to decode the request's output itself (inf: not known)."""
    if not max_new_tokens:
        return math.inf
    step = prefill.load.decode_step_s_at(prefill.load.running + 1) or decode.load.decode_step_s_at(1)
    return max_new_tokens * step if step > 0 else math.inf


def pull_rate(load: LoadReport, trust_s: float = 0.0) -> float:
    """The pull rate to predict a decode engine's transfers with: the one it measured
    (DEFAULT_TRANSFER_BPS before it has). A measure older than `trust_s` (0: trusted for good)
    is taken as 2^(age / trust_s - 1) times as fast, up to DEFAULT_TRANSFER_BPS: an old measure
    is worth no more than none, so a stale slow rate ends where a fresh gateway starts, and the
    requests it then hands over (as a fresh gateway would, until the next poll) measure it
    afresh. A measured rate above the default never changes with age."""
    measured = load.kv_transfer_bytes_per_s
    if not measured > 0:  # none yet (or nonsense: negative, NaN)
        return DEFAULT_TRANSFER_BPS
    periods = load.kv_transfer_age_s / trust_s - 1 if trust_s > 0 else 0.0
    if not periods > 0 or measured >= DEFAULT_TRANSFER_BPS:
        return measured
    return measured * 2 ** min(periods, math.log2(DEFAULT_TRANSFER_BPS / measured))  # no overflow


def transfer_s(decode: Engine, request: Request, rate: float) -> float:
    """Seconds for `decode` to pull the prompt's full blocks it lacks, at `rate` bytes/s."""
    full = request.prompt_tokens // request.block_size
    missing = max(0, full - request.held.get(decode.url, 0))
    return missing * request.block_size * decode.load.kv_bytes_per_token / rate
