"""Does HTTP load slow the engine core? `kvharbor serve` decodes the same batch twice: once quiet,
once while another process floods its /metrics and /load and holds many idle connections open.

Reports the core's own decode step time (the EWMA it puts in /load) and what the decoding clients
saw (mean inter-token latency, output tok/s), quiet against flooded, as ratios of the same run;
writes benchmarks/results/core_isolation.{json,png} with the machine it ran on.

    python benchmarks/core_isolation.py [--model PATH] [--dtype float32] [--requests 16] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_peers as peers
import serve as serve_bench

from kvharbor.common.machine import machine_record, machine_title
from kvharbor.launch.embedded_redis import free_port

RESULTS = Path(__file__).resolve().parent / "results"


def flood(url: str, seconds: float, pollers: int, idle: int, counts) -> None:
    """Another process: `pollers` threads polling /metrics and /load back to back, and `idle`
    keep-alive connections held open without a request, for `seconds`. It runs at the lowest
    priority: on a machine of two cores, clients that would be elsewhere in production must not
    take the cores the server needs (what is measured is the server's own work for the flood)."""
    os.nice(19)
    sockets = []
    with contextlib.suppress(OSError):
        import socket

        host, port = url.removeprefix("http://").split(":")
        for _ in range(idle):
            sockets.append(socket.create_connection((host, int(port)), timeout=5))
    deadline = time.monotonic() + seconds

    def poll(path: str, k: int) -> None:
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    client.get(url + path)
                    counts[k] += 1

    threads = [threading.Thread(target=poll, args=(("/metrics", "/load")[k % 2], k)) for k in range(pollers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in sockets:
        s.close()


def decode_phase(url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    prompts = serve_bench.make_prompts(args.requests, args.prompt_len, 0, (1000, 40000), seed)
    results, wall = asyncio.run(
        serve_bench.run_load(url, model, prompts, args.output_len, 0.0, args.concurrency, None, seed)
    )
    summary = serve_bench.summarize(results, wall, 1e9, 1e9)
    summary["core_decode_step_ms"] = httpx.get(url + "/load", timeout=10).json()["decode_step_ms"]
    return summary


def measure(url: str, model: str, args: argparse.Namespace) -> dict:
    decode_phase(url, model, args, seed=0)  # warm-up: the first steps of a process are slower
    quiet = decode_phase(url, model, args, seed=1)
    ctx = multiprocessing.get_context("spawn")
    counts = ctx.Array("l", args.pollers)
    noise = ctx.Process(
        target=flood, args=(url, quiet["wall_s"] * 3 + 30, args.pollers, args.idle, counts)
    )
    noise.start()
    try:
        time.sleep(1.0)  # let the flood reach speed
        started = time.monotonic()
        flooded = decode_phase(url, model, args, seed=2)
        polled = sum(counts)
        flooded["polls_per_s"] = polled / max(time.monotonic() - started, 1e-9)
    finally:
        noise.terminate()
        noise.join(10)
    return {"quiet": quiet, "flooded": flooded}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("core_decode_step_ms", "core decode step (ms)"), ("itl_mean_s", "client ITL mean (ms)"),
            ("output_tok_s", "output tok/s")]  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, title) in zip(axes, keys, strict=True):
        scale = 1000 if key == "itl_mean_s" else 1
        values = [result[p][key] * scale for p in ("quiet", "flooded")]
        ax.bar(["quiet", f"flooded\n({result['flooded']['polls_per_s']:.0f} polls/s)"], values, color=["C0", "C3"])
        ax.set_title(title)
    fig.suptitle(f"kvharbor serve: decoding under HTTP load — {machine_title(result['machine']['dtype'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model file or folder (default: the bundled SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pollers", type=int, default=4, help="threads polling /metrics and /load in the flood")
    ap.add_argument("--idle", type=int, default=64, help="idle connections the flood holds open")
    ap.add_argument("--nice", type=int, default=10, help="the server's --api-server-nice")
    ap.add_argument("--out", type=Path, default=RESULTS / "core_isolation.json")
    args = ap.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvharbor.launch.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--num-kv-blocks", "512", "--log-level", "warning", "--api-server-nice", str(args.nice)]  # fmt: skip
    cmd += ["--model", args.model] if args.model else []
    log = args.out.parent / "logs" / "core_isolation-serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with peers.server(cmd, url, "/ready", log, {}, timeout=300):
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        result = {"benchmark": "core_isolation", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  "machine": machine_record(args.dtype), "model": model,
                  "config": {k: str(v) for k, v in vars(args).items()}, **measure(url, model, args)}  # fmt: skip
    q, f = result["quiet"], result["flooded"]
    result["flooded_vs_quiet"] = {
        "core_decode_step": f["core_decode_step_ms"] / q["core_decode_step_ms"],
        "itl_mean": f["itl_mean_s"] / q["itl_mean_s"],
        "output_tok_s": f["output_tok_s"] / q["output_tok_s"],
    }
    print(f"{'':10}{'core step ms':>14}{'ITL mean ms':>13}{'out tok/s':>11}")
    for name, r in (("quiet", q), ("flooded", f)):
        print(f"{name:10}{r['core_decode_step_ms']:14.1f}{r['itl_mean_s'] * 1000:13.1f}{r['output_tok_s']:11.1f}")
    ratios = result["flooded_vs_quiet"]
    print(f"{'ratio':10}{ratios['core_decode_step']:14.2f}{ratios['itl_mean']:13.2f}{ratios['output_tok_s']:11.2f}")
    print(f"flood: {f['polls_per_s']:.0f} polls/s of /metrics and /load, {args.idle} idle connections")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
