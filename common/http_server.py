"""Running a kvharbor FastAPI app on uvicorn, the same way for every service.

Logging stays kvharbor's (JSON lines, request ids), access logs are off (each service logs its
own finished requests), and shutdown waits for open connections (5 s unless the part says: the
gateway's --drain-timeout). A part with an
admin listener (common/admin_listener.py) gets one server on two sockets, bound here.

A client gets --header-timeout seconds (10 by default) from connecting, or from the end of its
last response, to the end of a request's headers; then the connection is closed. uvicorn has no
such deadline: its keep-alive timer restarts on every byte received and is not armed before the
first request, so a client that connects and sends nothing, or trickles a header a byte at a time
(slowloris), held its connection for ever.
"""

from __future__ import annotations

import functools
import socket
import sys
from typing import Any

DRAIN_S = 5.0  # what SIGTERM gives open connections, unless the part sets its own
HEADER_TIMEOUT_S = 10.0  # common/server_config.py's --header-timeout default


def uvicorn_config(
    app: Any, host: str, port: int, drain_s: float = DRAIN_S, header_timeout: float = HEADER_TIMEOUT_S
) -> Any:
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=drain_s,
        http=header_deadline_protocol(header_timeout),
    )  # fmt: skip


@functools.cache
def header_deadline_protocol(timeout: float) -> type:
    """uvicorn's httptools protocol with a deadline for each request's headers (module docstring)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is None or self.cycle.response_complete:  # no pipelined request started
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._deadline = self.loop.call_later(timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


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
    app: Any,
    host: str,
    port: int,
    command: str,
    admin_port: int | None = None,
    drain_s: float = DRAIN_S,
    header_timeout: float = HEADER_TIMEOUT_S,
) -> int:
    """Serve until stopped; 0, or 2 with a message when an address cannot be bound. On SIGTERM,
    open connections get `drain_s` seconds to finish."""
    import uvicorn

    try:
        sockets = bind_listeners(host, port, admin_port)
    except OSError as exc:
        print(f"kvharbor {command}: error: cannot listen on {exc.strerror}; pick another port", file=sys.stderr)
        return 2
    uvicorn.Server(uvicorn_config(app, host, port, drain_s, header_timeout)).run(sockets=sockets)
    return 0
