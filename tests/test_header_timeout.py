"""--header-timeout (common/http_server.py) on a real uvicorn server on 127.0.0.1, run in a thread:
a connection that sends nothing, or trickles its headers (slowloris), is closed at the deadline;
a request whose headers arrive in time may take longer than the deadline to answer, and a kept-alive
connection serves a second request; the option's bounds."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from kvharbor.common.http_server import bind_listeners, uvicorn_config
from kvharbor.common.server_config import ServiceListenConfig

DEADLINE_S = 0.6


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    app = FastAPI()

    @app.get("/slow")
    async def slow() -> dict:
        await asyncio.sleep(2 * DEADLINE_S)  # answering may outlast the header deadline
        return {"ok": True}

    (sock,) = bind_listeners("127.0.0.1", 0, None)
    port = sock.getsockname()[1]
    config = uvicorn_config(app, "127.0.0.1", port, drain_s=1.0, header_timeout=DEADLINE_S)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):  # at most 10 s for start-up
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.settimeout(10)
    return conn


def _closed_after(conn: socket.socket, trickle: bytes = b"", every_s: float = 0.1) -> float:
    """Seconds until the server closes `conn`, sending `trickle` a byte at a time meanwhile."""
    t0 = time.monotonic()
    conn.setblocking(False)
    sent = 0
    while time.monotonic() - t0 < 10:
        try:
            if conn.recv(4096) == b"":
                return time.monotonic() - t0
        except BlockingIOError:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        if sent < len(trickle):
            try:
                conn.send(trickle[sent : sent + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
        time.sleep(every_s)
    raise AssertionError("the server kept the connection open for 10 s")


def _response(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_a_connection_that_sends_nothing_is_closed_at_the_deadline(server):
    with _connect(server) as conn:
        assert DEADLINE_S * 0.8 <= _closed_after(conn) < DEADLINE_S + 3


def test_headers_trickled_a_byte_at_a_time_are_cut_off(server):
    headers = b"GET /slow HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    with _connect(server) as conn:
        assert _closed_after(conn, headers) < DEADLINE_S + 3  # 200 bytes at 0.1 s would take 20 s


def test_a_request_in_time_may_be_answered_after_the_deadline_and_the_connection_kept(server):
    with _connect(server) as conn:
        for _ in range(2):  # the deadline restarts after each response, for the next request's headers
            conn.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = _response(conn)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"ok":true}')


@pytest.mark.parametrize("bad", [0, -1, 3601])
def test_the_header_timeout_must_be_positive_and_at_most_an_hour(bad):
    with pytest.raises(ValueError, match="header_timeout"):
        ServiceListenConfig(header_timeout=bad)
