"""CounterBoard: the engine core's own counters (KV events, the shared block store, P/D hand-offs,
structured outputs), kept by the core (EngineCore.board) and counted into by its parts and by the
core process. A snapshot crosses the core link in core_io.CoreStats; the API server's metrics
(engine/serve/metrics.py) export each name below as `kvharbor_<name>_total`."""

from __future__ import annotations

# name -> (help, label name or None).
BOARD: dict[str, tuple[str, str | None]] = {
    "kv_events_published": ("KV events written to Redis", None),
    "kv_events_dropped": ("KV events lost (Redis down, queue full)", None),
    "kv_store_pulled_blocks": ("KV blocks loaded from the shared store", None),
    "kv_store_pulled_bytes": ("Bytes of KV loaded from the shared store", None),
    "kv_store_pushed_blocks": ("KV blocks written to the shared store", None),
    "kv_store_pushed_bytes": ("Bytes of KV written to the shared store", None),
    "kv_store_push_dropped_blocks": ("KV blocks not written (queue full, store down)", None),
    "kv_store_refused_blocks": ("Shared-store blocks refused, by reason", "reason"),
    "kv_store_errors": ("Shared-store calls that failed, by operation", "op"),
    "kv_handoff_sent_blocks": ("P/D: KV blocks sent to decode engines", None),
    "kv_handoff_sent_bytes": ("P/D: bytes of KV sent to decode engines", None),
    "kv_handoff_pulled_blocks": ("P/D: KV blocks pulled from prefill engines and used", None),
    "kv_handoff_pulled_bytes": ("P/D: bytes moved by pulls from prefill engines", None),
    "kv_handoff_pull_seconds": ("P/D: seconds spent pulling from prefill engines", None),
    "kv_handoff_pulls": ("P/D: pulls from prefill engines, by result (ok, partial, refused, unreachable)", "result"),
    "structured_requests": ("Requests with a structured output, by kind (json, regex, choice, grammar)", "kind"),
    "structured_compiles": ("Grammar lookups, by result (hit: compiled before, miss: compiled now)", "result"),
    "structured_compile_seconds": ("Seconds spent compiling and looking up grammars", None),
}


class CounterBoard:
    """The counters as a plain dict that crosses the process link: {name: {label: value}} ("" is
    the label of an unlabelled counter). Thread-safe enough for += from one writer each."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, float]] = {name: {} for name in BOARD}

    def inc(self, name: str, amount: float = 1, label: str = "") -> None:
        series = self.values[name]  # KeyError for a name not in BOARD: a typo, not a new metric
        series[label] = series.get(label, 0) + amount

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {name: dict(series) for name, series in self.values.items()}
