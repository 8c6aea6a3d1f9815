"""Every kopf handler of the operator, and nothing else: each is a thin shim over a plain async
function in operator/reconcile.py or operator/tenant_sync.py, which decide; the shims only hand
over the body, write the returned status through kopf's patch, and post the returned events.

Handlers are registered by `register(registry, config)` rather than at import, because the timer
interval and retry back-off come from the configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx
import kopf

from kvharbor.common.kube import Kube
from kvharbor.operator.config import OperatorConfig
from kvharbor.operator.reconcile import (
    OperatorContext,
    Pending,
    finalize_service,
    observe_service,
    reconcile_service,
)
from kvharbor.operator.status import Event, Outcome, event_manifest
from kvharbor.operator.tenant_sync import report_status, sync_tenants

GROUP, VERSION = "kvharbor.io", "v1alpha1"
SERVICES, TENANTS = "inferenceservices", "tenants"

log = logging.getLogger("kvharbor.operator")


def configure(settings: kopf.OperatorSettings) -> None:
    # Handler progress and the last-handled spec live in annotations under our own prefix:
    # the CRDs' structural schemas would prune anything kopf wrote into .status.
    settings.persistence.finalizer = "kvharbor.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvharbor.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kvharbor.io")
    settings.posting.reporting_component = "kvharbor-operator"
    settings.posting.event_name_prefix = "kvharbor-"


def apply(outcome: Outcome, body: kopf.Body, patch: kopf.Patch) -> None:
    for key, value in outcome.status.items():
        patch.status[key] = value
    post(body, outcome.events)


def post(body: kopf.Body, events: list[Event]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


async def run_tenant_sync(ctx: OperatorContext, trigger: asyncio.Event) -> None:
    """Rebuild the gateway's tenants Secret when a Tenant changes, and every interval (key rotation)."""
    cfg = ctx.config
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(trigger.wait(), timeout=cfg.watch.interval)
        trigger.clear()
        try:
            sync = await sync_tenants(
                ctx.kube, cfg.tenants.tenants_secret, cfg.tenants.tenants_namespace, cfg.watch.namespace_list()
            )
            if sync.written != "unchanged":
                log.info("gateway tenants secret %s", sync.written, extra={"tenants": len(sync.tenants)})
            for tenant, ok, message in await report_status(ctx.kube, sync):
                event = Event("Normal", "Synced", message) if ok else Event("Warning", "Invalid", message)
                await ctx.kube.create(event_manifest(tenant, event))
        except Exception:  # keep syncing: one bad pass must not stop tenants from ever updating
            log.exception("tenant sync failed; retrying in %.0f s", cfg.watch.interval)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    backoff = min(config.watch.interval, 10.0)
    trigger = asyncio.Event()
    trigger.set()  # the first sync runs at once: the gateway waits for its tenants Secret
    tasks: list[asyncio.Task] = []

    @kopf.on.login(registry=registry)
    def login(**kwargs) -> kopf.ConnectionInfo | None:
        # A registry of our own gets none of kopf's default logins: use the kubernetes client's
        # (in-cluster service account, else $KUBECONFIG), as Kube.from_environment does.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
        configure(settings)
        index = None
        if config.engine.redis_url:
            from kvharbor.kvcache_service.redis_index import RedisIndex

            index = RedisIndex.from_url(config.engine.redis_url, timeout=2.0)
        memo.ctx = OperatorContext(config, Kube.from_environment(), httpx.AsyncClient(), index)
        tasks.append(asyncio.create_task(run_tenant_sync(memo.ctx, trigger)))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_) -> None:
        for task in tasks:
            task.cancel()
        await memo.ctx.close()

    @kopf.on.create(GROUP, VERSION, SERVICES, registry=registry, backoff=backoff)
    @kopf.on.update(GROUP, VERSION, SERVICES, registry=registry, backoff=backoff)
    @kopf.on.resume(GROUP, VERSION, SERVICES, registry=registry, backoff=backoff)
    async def service_changed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_) -> None:
        async with memo.ctx.lock(body):
            apply(await reconcile_service(memo.ctx, dict(body)), body, patch)

    interval = config.watch.interval

    # The first tick waits an interval: the create handler places and deploys first.
    @kopf.timer(GROUP, VERSION, SERVICES, registry=registry, interval=interval, initial_delay=interval, backoff=backoff)
    async def service_tick(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_) -> None:
        async with memo.ctx.lock(body):
            apply(await observe_service(memo.ctx, dict(body)), body, patch)

    @kopf.on.delete(GROUP, VERSION, SERVICES, registry=registry, backoff=backoff)
    async def service_deleted(body: kopf.Body, memo: kopf.Memo, **_) -> None:
        try:
            async with memo.ctx.lock(body):
                post(body, (await finalize_service(memo.ctx, dict(body))).events)
        except Pending as exc:
            post(body, exc.events)
            raise kopf.TemporaryError(str(exc), delay=exc.delay) from None

    @kopf.on.event(GROUP, VERSION, TENANTS, registry=registry)
    async def tenant_event(**_) -> None:
        trigger.set()
