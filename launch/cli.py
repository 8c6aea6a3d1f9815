"""The `kvharbor` command: a thin front door that hands each subcommand to the part that owns it.

Subcommands are imported only when chosen, so `kvharbor gateway` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvharbor.common import __version__

# name -> (module with main(argv, prog), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("kvharbor.engine.cli", "complete a prompt offline with the engine"),
    "chat": ("kvharbor.engine.cli", "answer one chat message offline with the engine"),
    "serve": ("kvharbor.engine.serve.server", "serve the OpenAI API from one engine (FastAPI on uvicorn)"),
    "up": ("kvharbor.launch.up", "run the whole platform here: Redis, KV cache service, engines, gateway"),
    "gateway": ("kvharbor.gateway.service", "serve the tenants' OpenAI API: auth, limits, prefix routing, admission"),
    "kvcache": (
        "kvharbor.kvcache_service.service",
        "run the KV cache service: prefix index, leases, shared block store",
    ),
    "kv-bridge": ("kvharbor.kv_bridge.service", "bridge a vLLM pod's KV events into kvharbor's KV index (a sidecar)"),
    "operator": ("kvharbor.operator.service", "reconcile InferenceService and Tenant resources in Kubernetes (kopf)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvharbor",
        description="kvharbor: a multi-tenant LLM inference platform. Run `kvharbor COMMAND --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"kvharbor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # handles --help/--version, and errors on unknown commands
        if args.command is None:
            parser.print_help()
            return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest, prog=f"kvharbor {name}", command=name) or 0)


if __name__ == "__main__":
    sys.exit(main())
