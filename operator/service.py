"""`kvharbor operator`: reconcile InferenceService and Tenant resources onto the cluster (kopf).

It places each InferenceService on a GPU node pool that fits, runs its engines (Deployment,
Service, PodDisruptionBudget, ConfigMap), scales them on load, drains and cleans them up, and
turns Tenants into the gateway's tenants Secret. Credentials: the in-cluster service account,
else $KUBECONFIG. Options are flags, KVHARBOR_* variables or a YAML file (--config).
"""

from __future__ import annotations

import logging

from kvharbor.common.config import config_from_argv
from kvharbor.common.logs import setup_logging

log = logging.getLogger("kvharbor.operator")


def main(argv: list[str], prog: str = "kvharbor operator", command: str = "operator") -> int:
    from kvharbor.operator.config import OperatorConfig

    config = config_from_argv(OperatorConfig, argv, prog, __doc__.splitlines()[0])
    setup_logging(config.server.log_level, config.server.log_json)
    return run(config)


def run(config) -> int:
    import kopf

    from kvharbor.operator.handlers import register

    registry = kopf.OperatorRegistry()
    register(registry, config)
    namespaces = config.watch.namespace_list()
    host, port = config.server.host, config.server.port
    log.info(
        "starting operator",
        extra={
            "namespaces": namespaces or "all",
            "redis": bool(config.engine.redis_url),
            "image": config.engine.engine_image,
        },
    )
    kopf.run(
        registry=registry,
        standalone=True,  # one replica (the chart's Deployment uses Recreate): no peering objects needed
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=f"http://{host}:{port}/healthz" if port else None,
    )
    return 0
