"""`kvharbor gateway`: serve the tenants' OpenAI API in front of the engines (auth, limits, routing, admission).

Options are flags, KVHARBOR_* variables or a YAML file (--config), with the same names. One model
is set with --engines (and --model / --served-model-name for its tokenizer); several with
--models-file. Tenants come from --tenants-file, re-read when it changes.
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
from kvharbor.common.redis_client import credentials_refused

log = logging.getLogger("kvharbor.gateway.service")


def main(argv: list[str], prog: str = "kvharbor gateway", command: str = "gateway") -> int:
    from kvharbor.gateway.config import GatewayConfig
    from kvharbor.gateway.tenants import TenantsError

    config = config_from_argv(GatewayConfig, argv, prog, __doc__.splitlines()[0])
    setup_logging(config.server.log_level, config.server.log_json)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call is noise
    if credentials_refused(config.tenancy.redis_url, prog):  # a wrong password stops here, not in retries
        return 2
    try:
        return serve(config)
    except (ValueError, FileNotFoundError, TenantsError) as exc:
        print(f"kvharbor gateway: error: {exc}", file=sys.stderr)
        return 2


def _discovery(config: Any):
    """The configured models; in kubernetes mode their engines come later, from EndpointSlices."""
    from kvharbor.gateway.discovery import StaticDiscovery

    s = config.serving
    static = s.discovery == "static"
    if s.models_file:
        return StaticDiscovery.from_file(s.models_file, s.slo_ttft_ms, s.slo_itl_ms, require_engines=static)
    return StaticDiscovery.from_flags(
        s.engines, s.model, s.served_model_name, s.slo_ttft_ms, s.slo_itl_ms, require_engines=static
    )


def _kubernetes_discovery(config: Any, specs: dict) -> Any:
    from kvharbor.common.kube import Kube
    from kvharbor.gateway.discovery import KubernetesDiscovery

    namespace = config.serving.discovery_namespace or _pod_namespace()
    kube = Kube.from_environment()

    async def api_get(url: str) -> dict:
        return await kube.get(url) or {}

    discovery = KubernetesDiscovery(api_get, namespace, specs)
    discovery.kube = kube  # closed with the gateway
    return discovery


def _pod_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip()
    except OSError:
        raise ValueError("--discovery kubernetes outside a pod needs --discovery-namespace NAMESPACE") from None


def build_state(config: Any, tracer: Any = None):
    """Everything the app needs; raises ValueError / FileNotFoundError / TenantsError with a hint."""
    import httpx

    from kvharbor.common.model_files import load_tokenizer
    from kvharbor.common.tracing import setup_tracing
    from kvharbor.gateway.admission import AdmissionQueue
    from kvharbor.gateway.call import ModelEntry
    from kvharbor.gateway.engines import EnginePool
    from kvharbor.gateway.limits import RateLimiter
    from kvharbor.gateway.metrics import GatewayMetrics
    from kvharbor.gateway.proxy import EngineCaller
    from kvharbor.gateway.response_store import MemoryResponseStore, RedisResponseStore
    from kvharbor.gateway.router import Router
    from kvharbor.gateway.state import GatewayState
    from kvharbor.gateway.tenants import TenantRegistry

    if not config.tenancy.tenants_file:
        raise ValueError("no tenants: pass --tenants-file FILE (gateway/README.md shows the format)")
    tenants = TenantRegistry(config.tenancy.tenants_file)
    discovery = _discovery(config)
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
    admission = AdmissionQueue(config.admission.max_queue, config.admission.queue_timeout)
    pool = EnginePool(
        http, config.resilience.eject_after_failures, config.routing.load_interval, on_change=admission.wake,
        vllm_priority=config.serving.vllm_priority, stall_timeout=config.resilience.engine_stall_timeout,
    )  # fmt: skip
    models, specs = {}, {}
    for spec in discovery.models():
        print(
            f"[kvharbor] reading the tokenizer of {spec.name or spec.files or 'the bundled model'} ...",
            file=sys.stderr,
            flush=True,
        )
        name, tokenizer = load_tokenizer(spec.files, spec.name)
        models[name] = ModelEntry(name, tokenizer, spec.slo_ttft_ms / 1000, spec.slo_itl_ms / 1000, spec.block_size,
                                  task=spec.task)  # fmt: skip
        pool.set_engines(name, list(spec.engines))
        specs[name] = spec
    limiter_client = index = None
    if config.tenancy.redis_url:
        from kvharbor.common.redis_client import connect
        from kvharbor.kvcache_service.redis_index import RedisIndex

        limiter_client = connect(config.tenancy.redis_url, timeout=0.5)  # one server or a Redis Cluster
        index = RedisIndex.from_url(config.tenancy.redis_url, timeout=config.routing.index_timeout)
    res = config.resilience
    stored = config.responses
    if limiter_client is not None:
        responses = RedisResponseStore(limiter_client, stored.response_store_ttl, stored.response_store_budget_bytes)
    else:
        responses = MemoryResponseStore(stored.response_store_ttl, stored.response_store_budget_bytes)
    return GatewayState(
        models=models,
        tenants=tenants,
        limiter=RateLimiter(limiter_client, config.tenancy.limits_on_redis_failure),
        pool=pool,
        router=Router(config.routing, index),
        admission=admission,
        caller=EngineCaller(http, pool, res.connect_timeout, res.first_token_timeout, res.request_timeout),
        metrics=GatewayMetrics(),
        tracer=tracer or setup_tracing("gateway", config.server.otlp_endpoint),
        max_attempts=res.max_attempts,
        max_prompt_tokens=res.max_prompt_tokens,
        max_body_bytes=res.max_body_bytes,
        limits=config.limits,
        stream_deadline=res.stream_deadline,
        stream_idle=res.stream_idle_timeout,
        max_migrations=res.max_migrations,
        index=index,
        responses=responses,
        responses_ttl=stored.response_store_ttl,
        discovery=_kubernetes_discovery(config, specs) if config.serving.discovery == "kubernetes" else None,
        discovery_interval=config.serving.discovery_interval,
    )


async def _follow_discovery(state: Any) -> None:
    """Re-read the engine Services and EndpointSlices; on an API error keep the engines known so far."""
    known: dict[str, tuple[str, ...]] = {}
    while True:
        try:
            for spec in await state.discovery.refresh():
                if known.get(spec.name) != spec.engines:
                    log.info("engines discovered", extra={"model": spec.name, "engines": list(spec.engines)})
                    known[spec.name] = spec.engines
                    state.pool.set_engines(spec.name, list(spec.engines))
                    state.admission.wake()
        except Exception as exc:  # the API server may be briefly away; routing goes on meanwhile
            log.warning("engine discovery failed; keeping the engines known", extra={"error": repr(exc)})
        await asyncio.sleep(state.discovery_interval)


def lifespan_for(state: Any):
    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        from kvharbor.common.tracing import shutdown

        tasks = [asyncio.create_task(state.pool.poll_forever())]
        if state.discovery is not None:
            tasks.append(asyncio.create_task(_follow_discovery(state)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await state.caller.http.aclose()
            if state.discovery is not None:
                await state.discovery.kube.close()
            if state.index is not None:
                await state.index.close()
            if state.limiter.client is not None:
                await state.limiter.client.aclose()
            shutdown()

    return lifespan


def serve(config: Any) -> int:
    from kvharbor.gateway.app import build_app

    state = build_state(config)
    srv = config.server
    url = f"http://{srv.host}:{srv.port}"
    engines = {m: [e.url for e in state.pool.all(m)] for m in state.models}
    print(
        f"[kvharbor] gateway on {url}: models {engines}, routing {config.routing.routing}, "
        f"tenants from {config.tenancy.tenants_file}; metrics on http://{srv.host}:{srv.admin_port}/metrics\n"
        f"[kvharbor] try: curl -s {url}/v1/models -H 'Authorization: Bearer <your key>'",
        file=sys.stderr,
        flush=True,
    )
    app = build_app(state, lifespan=lifespan_for(state), admin_port=srv.admin_port)
    return serve_app(
        app, srv.host, srv.port, "gateway", admin_port=srv.admin_port, drain_s=srv.drain_timeout,
        header_timeout=srv.header_timeout,
    )  # fmt: skip
