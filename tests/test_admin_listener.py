"""The admin listener (common/admin_listener.py): which paths answer on which port, and the config
rules of --admin-port. The real processes are checked in tests/test_gateway.py."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from fastapi import FastAPI

from kvharbor.common.admin_listener import ListenerSplit
from kvharbor.common.http_server import bind_listeners

MAIN, ADMIN = 8000, 9090


def _app(admin_port: int | None) -> FastAPI:
    app = FastAPI()
    for path in ("/v1/models", "/metrics", "/stats", "/health", "/ready", "/load"):
        app.get(path)(lambda: {"ok": True})
    both = ("/health", "/ready", "/load")
    app.add_middleware(ListenerSplit, admin_port=admin_port, admin_paths=("/metrics", "/stats"), both=both)
    return app


def _status(app: FastAPI, port: int, path: str) -> int:
    async def go() -> int:
        transport = httpx.ASGITransport(app=app)  # the URL's port becomes scope["server"]
        async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{port}") as client:
            return (await client.get(path)).status_code

    return asyncio.run(go())


@pytest.mark.parametrize(
    "path, on_main, on_admin",
    [("/v1/models", 200, 404), ("/metrics", 404, 200), ("/stats", 404, 200), ("/health", 200, 200),
     ("/ready", 200, 200), ("/load", 200, 200), ("/nowhere", 404, 404)],
)  # fmt: skip
def test_each_path_answers_on_its_listener(path, on_main, on_admin):
    app = _app(ADMIN)
    assert _status(app, MAIN, path) == on_main
    assert _status(app, ADMIN, path) == on_admin


def test_without_an_admin_port_every_path_is_on_the_one_listener():
    app = _app(None)
    assert [_status(app, MAIN, p) for p in ("/v1/models", "/metrics", "/stats")] == [200, 200, 200]


def test_the_refusal_is_an_openai_error_that_says_where_to_look():
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=_app(ADMIN))
        async with httpx.AsyncClient(transport=transport, base_url=f"http://127.0.0.1:{MAIN}") as client:
            return await client.get("/metrics")

    err = asyncio.run(go()).json()["error"]
    assert err["type"] == "not_found_error" and "--admin-port" in err["message"]


def test_admin_port_config_rules():
    from kvharbor.engine.config import ServerConfig
    from kvharbor.gateway.config import GatewayServerConfig
    from kvharbor.kvcache_service.config import ServiceServerConfig

    assert ServerConfig().admin_port is None and ServiceServerConfig().admin_port is None
    assert GatewayServerConfig().admin_port == 9090
    for cls in (ServerConfig, GatewayServerConfig, ServiceServerConfig):
        with pytest.raises(ValueError, match="admin_port must differ from port"):
            cls(port=7000, admin_port=7000)
        with pytest.raises(ValueError, match=r"admin_port must be in 1\.\.65535"):
            cls(admin_port=70000)
    with pytest.raises(ValueError, match="admin_port is required for the gateway"):
        GatewayServerConfig(admin_port=None)


def test_admin_port_comes_from_flags_env_and_yaml(tmp_path, monkeypatch):
    from kvharbor.common.config import config_from_argv
    from kvharbor.gateway.config import GatewayConfig

    assert config_from_argv(GatewayConfig, ["--admin-port", "9191"], "t", "t").server.admin_port == 9191
    monkeypatch.setenv("KVHARBOR_ADMIN_PORT", "9292")
    assert config_from_argv(GatewayConfig, [], "t", "t").server.admin_port == 9292
    monkeypatch.delenv("KVHARBOR_ADMIN_PORT")
    (tmp_path / "c.yaml").write_text("admin_port: 9393\n")
    assert config_from_argv(GatewayConfig, ["--config", str(tmp_path / "c.yaml")], "t", "t").server.admin_port == 9393


def test_a_taken_admin_port_fails_naming_it_and_frees_the_main_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            main = probe.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{busy}"):
            bind_listeners("127.0.0.1", main, busy)
        for sock in bind_listeners("127.0.0.1", main, None):  # the main port was released by the failure
            sock.close()
