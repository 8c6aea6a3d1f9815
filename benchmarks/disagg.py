"""Prefill/decode disaggregation against colocated serving, on the same cores and engine count.

    python benchmarks/disagg.py       # writes benchmarks/results/disagg.{json,png}

Two set-ups, one after the other, each with two `kvharbor serve` engines (SmolLM2) pinned one per
CPU (--cpu-affinity), a real redis-server and one gateway:
- pd: one prefill engine and one decode engine; the gateway decides per request (gateway/disagg.py);
- colocated: two role-both engines behind prefix routing (the baseline, measured in the same run).

One workload for both, arriving as a Poisson process with a fixed seed: chat streams (short
prompts, --chat-output tokens) and long documents (--doc-len prompt tokens, a few output tokens),
at each of --doc-rates (documents per second, over the span of the chats' arrivals): how often
a document's prefill meets chats decoding is what P/D is about. Reported per load and set-up:
the chats' ITL p50/p95/p99/p99.9/max, TTFT p50/p95 of each class, output tok/s, goodput under
the load test's SLOs (loadtest/slos.yaml: chat and docqa), and KV bytes moved.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import MODEL, free_port, server
from serve import RequestResult, one_request, pct

from gateway import metric_sum  # benchmarks/gateway.py (this folder is first on sys.path)
from kvharbor.common.machine import machine_record, machine_title
from kvharbor.gateway.tenants import hash_key
from kvharbor.launch.embedded_redis import EmbeddedRedis

RESULTS = Path(__file__).resolve().parent / "results"
CLI = [sys.executable, "-m", "kvharbor.launch.cli"]
SLOS = yaml.safe_load((Path(__file__).resolve().parents[1] / "loadtest" / "slos.yaml").read_text())["tenants"]
SETUPS = {"pd": ("prefill", "decode"), "colocated": ("both", "both")}


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    kind: str  # chat | doc
    prompt: list[int]
    output: int


def workload(args: argparse.Namespace, doc_rate: float) -> list[Arrival]:
    """Both classes' Poisson arrivals, merged, with random token-id prompts (no cache hits between
    them); documents at `doc_rate`, as many as arrive on average while the chats do."""
    rng = random.Random(args.seed)
    out = []
    for kind, rate, n, length, output in (
        ("chat", args.chat_rate, args.chats, args.chat_len, args.chat_output),
        ("doc", doc_rate, docs_at(args, doc_rate), args.doc_len, args.doc_output),
    ):
        t = 0.0
        for _ in range(n):
            t += rng.expovariate(rate)
            out.append(Arrival(t, kind, [rng.randrange(200, 40000) for _ in range(length)], output))
    return sorted(out, key=lambda a: a.at)


def docs_at(args: argparse.Namespace, doc_rate: float) -> int:
    return max(1, round(doc_rate * args.chats / args.chat_rate))


async def drive(gateway: str, arrivals: list[Arrival]) -> tuple[list[tuple[str, RequestResult]], float]:
    headers = {"Authorization": "Bearer sk-bench"}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers) as client:
        start = time.perf_counter()

        async def one(a: Arrival) -> tuple[str, RequestResult]:
            await asyncio.sleep(max(0.0, a.at - (time.perf_counter() - start)))
            return a.kind, await one_request(client, gateway, MODEL, a.prompt, a.output, 0.0)

        results = await asyncio.gather(*(one(a) for a in arrivals))
        return list(results), time.perf_counter() - start


def summarize(results: list[tuple[str, RequestResult]], wall: float, moved: float, decisions: dict) -> dict:
    by = {k: [r for kind, r in results if kind == k and r.ok] for k in ("chat", "doc")}
    itl = [x for r in by["chat"] for x in r.itls_s]
    out = {
        "errors": sum(not r.ok for _, r in results),
        "first_error": next((r.error for _, r in results if not r.ok), ""),
        "wall_s": wall,
        "output_tok_s": sum(r.output_tokens for _, r in results if r.ok) / wall,
        **{f"chat_itl_p{q}_ms": pct(itl, q) * 1000 for q in (50, 95, 99)},
        "chat_itl_p999_ms": pct(itl, 99.9) * 1000,
        "chat_itl_max_ms": max(itl, default=float("nan")) * 1000,
        "kv_bytes_moved": moved,
        "pd_decisions": decisions,
    }
    for kind, slo in (("chat", SLOS["chat"]), ("doc", SLOS["docqa"])):
        ttft = [r.ttft_s for r in by[kind]]
        out |= {f"{kind}_ttft_p{q}_ms": pct(ttft, q) * 1000 for q in (50, 95)}
        good = [r for r in by[kind] if r.ttft_s * 1000 <= slo["ttft_p95_ms"]
                and (pct(r.itls_s, 95) * 1000 if r.itls_s else 0) <= slo["itl_p95_ms"]]  # fmt: skip
        out[f"{kind}_goodput_rps"] = len(good) / wall
    return out


def decisions_of(gateway_admin: str) -> dict[str, float]:
    text = httpx.get(gateway_admin + "/metrics").text
    found = {}
    for line in text.splitlines():
        if line.startswith("kvharbor_gateway_pd_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = float(line.rsplit(" ", 1)[1])
    return found


def run_setup(name: str, args: argparse.Namespace, arrivals: list[Arrival], logs: Path) -> dict:
    """One set-up's run; its processes' logs go to `logs` (a folder per load)."""
    roles = SETUPS[name]
    cpus = sorted(os.sched_getaffinity(0))
    with EmbeddedRedis() as rds, tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(yaml.safe_dump({"tenants": [{"name": "bench", "api_keys": [hash_key("sk-bench")]}]}))
        engines = [f"http://127.0.0.1:{free_port()}" for _ in roles]
        print(f"{name}: starting engines {roles} on CPUs {cpus[: len(roles)]} and a gateway ...", flush=True)
        for i, (url, role) in enumerate(zip(engines, roles, strict=True)):
            cmd = [*CLI, "serve", "--port", url.rsplit(":", 1)[1], "--instance-id", f"{name}-{i}", "--role", role,
                   "--redis-url", rds.url, "--dtype", args.dtype, "--num-kv-blocks", str(args.kv_blocks),
                   "--cpu-affinity", str(cpus[i % len(cpus)]), "--max-model-len", str(args.doc_len + 256)]  # fmt: skip
            stack.enter_context(server(cmd, url, "/ready", logs / f"{name}-{i}.log", {}, 300))
        gw, gw_admin = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        cmd = [*CLI, "gateway", "--port", gw.rsplit(":", 1)[1], "--admin-port", gw_admin.rsplit(":", 1)[1],
               "--engines", ",".join(engines),
               "--tenants-file", str(tenants), "--redis-url", rds.url, "--slo-ttft-ms", str(args.slo_ttft_ms),
               "--pd-min-gain-ms", str(args.pd_min_gain_ms), "--pd-transfer-trust-s", str(args.pd_transfer_trust_s),
               "--max-prompt-tokens", str(args.doc_len + 64),
               *(["--disaggregation", "off"] if name == "colocated" else [])]  # fmt: skip
        stack.enter_context(server(cmd, gw, "/ready", logs / f"{name}-gateway.log", {}, 120))
        print(f"{name}: warm-up ...", flush=True)
        warm = [Arrival(0.0, "chat", a.prompt[:48], 4) for a in arrivals[:4]] + [
            Arrival(0.0, "doc", [7] * args.doc_len, 2)
        ]
        asyncio.run(drive(gw, warm))
        print(f"{name}: {len(arrivals)} requests over ~{arrivals[-1].at:.0f} s ...", flush=True)
        moved0, decided0 = metric_sum(engines, "kvharbor_kv_handoff_pulled_bytes_total"), decisions_of(gw_admin)
        results, wall = asyncio.run(drive(gw, arrivals))
        moved = metric_sum(engines, "kvharbor_kv_handoff_pulled_bytes_total") - moved0
        decided = {k: v - decided0.get(k, 0.0) for k, v in decisions_of(gw_admin).items()}  # past the warm-up
        return summarize(results, wall, moved, decided)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = result["loads"]
    rates = [load["doc_rate"] for load in loads]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        (left, ["chat_itl_p50_ms", "chat_itl_p99_ms", "chat_itl_p999_ms"], "chats' inter-token latency (ms)"),
        (right, ["chat_ttft_p95_ms", "doc_ttft_p50_ms"], "TTFT (ms)"),
    )
    styles = {"colocated": "--", "pd": "-"}
    for ax, keys, title in panels:
        for name, style in styles.items():  # a colour per figure, a line style per set-up
            for i, key in enumerate(keys):
                values = [load["setups"][name][key] for load in loads]
                label = f"{name} {key.replace('_ms', '').replace('_', ' ')}"
                ax.plot(rates, values, style, color=f"C{i}", marker="o", label=label)
        ax.set_xlabel("documents per second (2,048-token prompts)")
        ax.set_xticks(rates)
        ax.set_title(title)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ratios = ", ".join(f"{load['doc_rate']}/s: {load['itl_p99_ratio']:.2f}x" for load in loads)
    fig.suptitle(f"P/D vs colocated, 2 engines pinned one per CPU; chat ITL p99 colocated/P/D {ratios}\n"
                 f"{result['title']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(result: dict) -> None:
    keys = ["chat_itl_p50_ms", "chat_itl_p95_ms", "chat_itl_p99_ms", "chat_itl_p999_ms", "chat_itl_max_ms",
            "chat_ttft_p50_ms", "chat_ttft_p95_ms", "doc_ttft_p50_ms", "doc_ttft_p95_ms", "output_tok_s",
            "chat_goodput_rps", "doc_goodput_rps", "kv_bytes_moved", "errors"]  # fmt: skip
    for load in result["loads"]:
        runs = load["setups"]
        print(f"\n{load['docs']} documents at {load['doc_rate']}/s" + "".join(f"{name:>14}" for name in runs))
        for k in keys:
            print(f"{k:22}" + "".join(f"{run[k]:>14.1f}" for run in runs.values()))
        print(f"chat ITL p99, colocated / pd: {load['itl_p99_ratio']:.2f}x (target >= 2x); "
              f"output tok/s, pd / colocated: {load['throughput_ratio']:.2f} (target within 15%)")  # fmt: skip


def run_load(args: argparse.Namespace, doc_rate: float, logs: Path) -> dict:
    arrivals = workload(args, doc_rate)
    folder = logs / f"disagg-{doc_rate}"
    folder.mkdir(exist_ok=True)
    runs = {name: run_setup(name, args, arrivals, folder) for name in ("colocated", "pd")}
    return {
        "doc_rate": doc_rate,
        "docs": docs_at(args, doc_rate),
        "setups": runs,
        "itl_p99_ratio": runs["colocated"]["chat_itl_p99_ms"] / runs["pd"]["chat_itl_p99_ms"],
        "throughput_ratio": runs["pd"]["output_tok_s"] / runs["colocated"]["output_tok_s"],
    }


def rates(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        message = f"give documents per second, comma-separated (e.g. 0.045,0.08): {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"each document rate must be > 0: {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=40, help="chat streams")
    ap.add_argument("--chat-rate", type=float, default=0.2, help="chat arrivals per second")
    ap.add_argument("--chat-len", type=int, default=64, help="chat prompt tokens")
    ap.add_argument("--chat-output", type=int, default=128, help="chat output tokens")
    # NOTE: one core prefills a 2,048-token document in ~9 s here (1,024-token chunks of 3.2-5.2 s
    # on the Zen 4 VM, float32): 0.08 documents/s keeps a lone prefill engine ~70% busy.
    ap.add_argument("--doc-rates", type=rates, default=[0.045, 0.06, 0.08],
                    help="document arrivals per second, one run of both set-ups each (comma-separated)")  # fmt: skip
    ap.add_argument("--doc-len", type=int, default=2048, help="document prompt tokens")
    ap.add_argument("--doc-output", type=int, default=4, help="document output tokens")
    ap.add_argument("--kv-blocks", type=int, default=1024, help="each engine's KV pool, in blocks of 16 tokens")
    ap.add_argument("--dtype", default="float32", help="engines' dtype (float32: the same on every CPU here)")
    ap.add_argument("--pd-min-gain-ms", type=float, default=50.0, help="the gateway's P/D threshold")
    ap.add_argument("--pd-transfer-trust-s", type=float, default=10.0,
                    help="seconds the gateway trusts a measured KV pull rate as it is (0: for good)")  # fmt: skip
    ap.add_argument("--slo-ttft-ms", type=float, default=float(SLOS["chat"]["ttft_p95_ms"]),
                    help="the gateway's TTFT target (admission, and P/D's TTFT rule)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "disagg.json", help="JSON output (PNG beside it)")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("this benchmark pins two engines to a CPU each: it needs 2 CPUs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent / "logs"
    logs.mkdir(exist_ok=True)
    result: dict = {
        "benchmark": "disagg",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": vars(args) | {"out": str(args.out)},
        "machine": machine_record(args.dtype),
        "title": machine_title(args.dtype),
        "loads": [run_load(args, rate, logs) for rate in args.doc_rates],
    }
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print_table(result)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if not any(r["errors"] for load in result["loads"] for r in load["setups"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
