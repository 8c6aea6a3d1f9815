"""The admin listener: metrics and operator-facing endpoints on `--admin-port`, off the tenants' port.

One uvicorn server listens on both sockets (one event loop, one lifespan, one drain), and
`ListenerSplit` sorts each request by the local port it came in on (`scope["server"]`, which
uvicorn takes from the socket itself, so a client cannot forge it with a Host header):
- an admin path (say /metrics, the gateway's only view of tenant names) answers on the admin
  port only; on the main port it is a 404, as if it did not exist;
- every other path answers on the main port only;
- the probes (/health, /ready) answer on both, so a kubelet may probe either port.

A part run without an admin port keeps one listener with every path on it (local use); the
gateway, the one part tenants reach, always has one.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvharbor.common.openai_api import APIError

PROBES = ("/health", "/ready")


class ListenerSplit:
    """Pure ASGI middleware; `admin_port` None turns it into a pass-through."""

    def __init__(self, app, admin_port: int | None, admin_paths: Iterable[str], both: Iterable[str] = PROBES) -> None:
        self.app = app
        self.admin_port = admin_port
        self.admin_paths = frozenset(admin_paths)
        self.both = frozenset(both)

    async def __call__(self, scope: dict, receive, send) -> None:
        if self.admin_port is None or scope["type"] != "http" or scope["path"] in self.both:
            await self.app(scope, receive, send)
            return
        on_admin = _local_port(scope) == self.admin_port
        if (scope["path"] in self.admin_paths) == on_admin:
            await self.app(scope, receive, send)
            return
        from kvharbor.common.http_errors import send_error

        where = "this server's admin listener (--admin-port)" if not on_admin else "the main port, not the admin one"
        err = APIError(404, f"{scope['path']} is served on {where}", type="not_found_error", code="not_found")
        await send_error(send, err)


def _local_port(scope: dict) -> int | None:
    server = scope.get("server")
    return server[1] if server else None

