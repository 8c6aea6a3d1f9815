"""`kvharbor kv-bridge`: a vLLM pod's KV events into kvharbor's KV index (a sidecar per pod).

It subscribes to the pod's ZMQ KV events (replaying from 0 on each connection and on a gap), recomputes
kvharbor's block hashes from the token ids, and publishes them to the pod's Redis Stream under a
lease, as a kvharbor engine does. /health answers 200 while it runs; /metrics counts batches,
malformed ones, unknown events, orphan blocks, gaps, connections, replays and rebuilds.

With --vllm-metrics-url, /metrics serves the vLLM server's own exposition after the bridge's (as
Istio's sidecars merge an app's metrics): a pod's scrape annotation names one port, and this one
then carries both. `kvharbor_kv_bridge_vllm_metrics_up` says whether the server answered.

Options are flags, KVHARBOR_* variables or a YAML file (--config), with the same names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from typing import Any

from kvharbor.common.config import config_from_argv
from kvharbor.common.logs import setup_logging
from kvharbor.common.redis_client import credentials_refused

log = logging.getLogger("kvharbor.kv_bridge")
VLLM_METRICS_TIMEOUT_S = 5.0  # under Prometheus' default scrape timeout (10 s)


def main(argv: list[str], prog: str = "kvharbor kv-bridge", command: str = "kv-bridge") -> int:
    from kvharbor.kv_bridge.config import KVBridgeConfig

    config = config_from_argv(KVBridgeConfig, argv, prog, __doc__.splitlines()[0])
    setup_logging(config.server.log_level, config.server.log_json)
    if credentials_refused(config.bridge.redis_url, prog):
        return 2
    return asyncio.run(serve(config))


async def serve(config: Any) -> int:
    import httpx
    import uvicorn
    import zmq.asyncio

    from kvharbor.common.kv_publisher import KVEventPublisher
    from kvharbor.kv_bridge.bridge import KVBridge
    from kvharbor.kv_bridge.translate import BlockSizeMismatch

    opts = config.bridge
    publisher = KVEventPublisher(opts.redis_url, opts.model, opts.instance_id, opts.kv_events_stream_prefix,
                                 opts.lease_ttl)  # fmt: skip
    bridge = KVBridge(opts, publisher)
    client = httpx.AsyncClient(timeout=VLLM_METRICS_TIMEOUT_S)
    server = uvicorn.Server(uvicorn.Config(_app(bridge, client), host=config.server.host, port=config.server.port,
                                           log_config=None, lifespan="off"))  # fmt: skip
    ctx = zmq.asyncio.Context()
    log.info("bridging vLLM KV events", extra={"events": opts.vllm_events, "replay": opts.vllm_replay,
                                               "model": opts.model, "instance_id": opts.instance_id})  # fmt: skip
    tasks = [asyncio.create_task(bridge.run(ctx)), asyncio.create_task(publisher.run(bridge.snapshot, opts.block_size)),
             asyncio.create_task(server.serve())]  # fmt: skip
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if (exc := task.exception()) is not None:
                raise exc
        return 0
    except BlockSizeMismatch as exc:
        print(f"kvharbor kv-bridge: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        await publisher.stop()
        await client.aclose()
        ctx.term()


def _app(bridge: Any, client: Any) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse

    app = FastAPI(title="kvharbor kv-bridge")

    @app.get("/health")
    async def health() -> JSONResponse:
        if bridge.refused:
            return JSONResponse({"status": "refused", "reason": bridge.refused}, status_code=503)
        return JSONResponse({"status": "ok", "blocks": bridge.translator.size})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        own = _metrics(bridge)
        if bridge.options.vllm_metrics_url is None:
            return PlainTextResponse(own)
        return PlainTextResponse(own + await _vllm_metrics(client, bridge.options.vllm_metrics_url, bridge.labels))

    return app


def _metrics(bridge: Any) -> str:
    counts, tr, seq, pub = bridge.counts, bridge.translator, bridge.sequencer, bridge.publisher
    rows = {
        "batches": counts.batches, "malformed_batches": counts.malformed, "unknown_events": counts.unknown_events,
        "orphan_blocks": tr.orphans, "unknown_removed_blocks": tr.unknown_removed, "gaps": seq.gaps,
        "connects": counts.connects, "replays": counts.replays, "rebuilds": seq.rebuilds,
        "events_published": pub.published, "events_dropped": pub.dropped,
    }  # fmt: skip
    labels = bridge.labels
    lines = []
    for name, value in rows.items():
        metric = f"kvharbor_kv_bridge_{name}_total"
        lines += [f"# TYPE {metric} counter", f"{metric}{{{labels}}} {value}"]
    lines += ["# TYPE kvharbor_kv_bridge_blocks gauge", f"kvharbor_kv_bridge_blocks{{{labels}}} {tr.size}"]
    return "\n".join(lines) + "\n"


async def _vllm_metrics(client: Any, url: str, labels: str) -> str:
    """A gauge saying whether the vLLM server answered, then its exposition (asked without an
    Accept header, so in the Prometheus text format the bridge's own is in, not OpenMetrics)."""
    import httpx

    try:
        resp = await client.get(url)
        resp.raise_for_status()
        text, up = resp.text, 1
    except httpx.HTTPError as exc:
        log.warning("vLLM's /metrics did not answer; serving the bridge's own", extra={"error": type(exc).__name__})
        text, up = "", 0
    gauge = "kvharbor_kv_bridge_vllm_metrics_up"
    text = text if not text or text.endswith("\n") else text + "\n"
    return f"# TYPE {gauge} gauge\n{gauge}{{{labels}}} {up}\n{text}"
