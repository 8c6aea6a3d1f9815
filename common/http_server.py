"""Running a kvharbor FastAPI app on uvicorn, the same way for every service.

Logging stays kvharbor's (JSON lines, request ids), access logs are off (each service logs its
own finished requests), and shutdown waits a few seconds for open connections.
"""

from __future__ import annotations

import sys
from typing import Any


def uvicorn_config(app: Any, host: str, port: int) -> Any:
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5
    )


def serve_app(app: Any, host: str, port: int, command: str) -> int:
    """Serve until stopped; 0, or 2 with a message when the address cannot be bound."""
    import uvicorn

    try:
        uvicorn.Server(uvicorn_config(app, host, port)).run()
    except OSError as exc:
        print(f"kvharbor {command}: error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    return 0
