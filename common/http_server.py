"""Running a kvharbor FastAPI app on uvicorn, the same way for every service.

Logging stays kvharbor's (JSON lines, request ids), access logs are off (each service logs its
own finished requests), and shutdown waits for open connections (5 s unless the part says: the
gateway's --drain-timeout). A part with an
admin listener (common/admin_listener.py) gets one server on two sockets, bound here.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

DRAIN_S = 5.0  # what SIGTERM gives open connections, unless the part sets its own


def uvicorn_config(app: Any, host: str, port: int, drain_s: float = DRAIN_S) -> Any:
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=drain_s
    )


def bind_listeners(host: str, port: int, admin_port: int | None) -> list[socket.socket]:
    """The listening sockets, main first; OSError names the port that could not be bound."""
    sockets: list[socket.socket] = []
    try:
        for p in (port, admin_port):
            if p is not None:
                sockets.append(_bind(host, p))
    except OSError as exc:
        for s in sockets:
            s.close()
        raise OSError(exc.errno, f"{host}:{p}: {exc.strerror or exc}") from exc
    return sockets


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts rebind at once
        sock.bind((host, port))  # not listening yet: until uvicorn serves, connections are refused
    except OSError:
        sock.close()
        raise
    return sock


def serve_app(
    app: Any, host: str, port: int, command: str, admin_port: int | None = None, drain_s: float = DRAIN_S
) -> int:
    """Serve until stopped; 0, or 2 with a message when an address cannot be bound. On SIGTERM,
    open connections get `drain_s` seconds to finish."""
    import uvicorn

    try:
        sockets = bind_listeners(host, port, admin_port)
    except OSError as exc:
        print(f"kvharbor {command}: error: cannot listen on {exc.strerror}; pick another port", file=sys.stderr)
        return 2
    uvicorn.Server(uvicorn_config(app, host, port, drain_s)).run(sockets=sockets)
    return 0
