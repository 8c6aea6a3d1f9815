"""`kvharbor kvcache`: run the KV index service (event intake, leases, lookups, shared block store).

It consumes the engines' KV event streams into the Redis index, sweeps instances whose lease
expired, owns the shared block store's byte cap, and answers prefix lookups over HTTP.

Options are flags, KVHARBOR_* variables or a YAML file (--config), with the same names. It starts
even while Redis is down (/ready says so) and catches up when Redis comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from kvharbor.common.config import config_from_argv
from kvharbor.common.http_server import serve_app
from kvharbor.common.logs import setup_logging
from kvharbor.common.redis_client import credentials_refused, redact

log = logging.getLogger("kvharbor.kvcache.service")


def main(argv: list[str], prog: str = "kvharbor kvcache", command: str = "kvcache") -> int:
    from kvharbor.kvcache_service.config import KVCacheServiceConfig

    config = config_from_argv(KVCacheServiceConfig, argv, prog, __doc__.splitlines()[0])
    setup_logging(config.server.log_level, config.server.log_json)
    if credentials_refused(config.intake.redis_url, prog):  # a wrong password stops here, not in retries
        return 2
    return serve(config)


def build_state(config: Any):
    from kvharbor.common.redis_client import connect
    from kvharbor.kvcache_service.app import ServiceState
    from kvharbor.kvcache_service.block_store import RedisBlockStore
    from kvharbor.kvcache_service.consumer import EventConsumer
    from kvharbor.kvcache_service.metrics import ServiceMetrics
    from kvharbor.kvcache_service.redis_index import RedisIndex

    intake = config.intake
    timeout = intake.redis_timeout

    def client(**kwargs: Any):
        return connect(intake.redis_url, timeout=timeout, **kwargs)

    index = RedisIndex(client())
    # The intake's own index: its scripts and pipelines do not queue behind lookups.
    intake_index = RedisIndex(client())
    consumer = EventConsumer(
        client(),
        intake_index,
        group=intake.consumer_group,
        consumer=intake.consumer_name,
        stream_prefix=intake.kv_events_stream_prefix,
        owner_ttl=intake.owner_ttl,
        rebalance_interval=intake.rebalance_interval,
        batch=intake.intake_batch,
        sweep_interval=intake.lease_sweep_interval,
    )
    store = RedisBlockStore(client(), default_cap=config.store.cap_bytes)
    return ServiceState(
        index=index,
        store=store,
        consumer=consumer,
        reuse_client=client(),
        metrics=ServiceMetrics(),
        max_lookup_blocks=config.server.max_lookup_blocks,
    )


def serve(config: Any) -> int:
    from kvharbor.kvcache_service.app import build_app
    from kvharbor.kvcache_service.block_store import BlockStoreUnavailable

    state = build_state(config)

    async def keep_cap() -> None:
        # Engines read the cap from Redis on every put; after an outage, or a Redis that lost
        # the key, it must come back before they fall back to their built-in default.
        while True:
            with contextlib.suppress(BlockStoreUnavailable):
                await state.store.set_cap(config.store.cap_bytes)
            await asyncio.sleep(5.0)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(state.consumer.run()), asyncio.create_task(keep_cap())]
        try:
            yield
        finally:
            await state.consumer.stop()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for closer in (
                state.index.close,
                state.store.close,
                state.reuse_client.aclose,
                state.consumer.client.aclose,
                state.consumer.index.close,
            ):
                with contextlib.suppress(Exception):
                    await closer()

    srv = config.server
    url = f"http://{srv.host}:{srv.port}"
    admin = f"http://{srv.host}:{srv.admin_port}" if srv.admin_port else url
    print(
        f"[kvharbor] KV cache service on {url}: events from {redact(config.intake.redis_url)} "
        f"(streams {config.intake.kv_events_stream_prefix}*), store cap {config.store.store_max_bytes}\n"
        f"[kvharbor] try: curl -s {admin}/stats",
        file=sys.stderr,
        flush=True,
    )
    app = build_app(state, lifespan=lifespan, admin_port=srv.admin_port)
    return serve_app(app, srv.host, srv.port, "kvcache", admin_port=srv.admin_port, header_timeout=srv.header_timeout)
