"""The whole platform under the load-test personas, with `prefix` routing and then `round_robin`.

    python benchmarks/platform_load.py   # writes benchmarks/results/platform.{json,png}

Each run starts `kvharbor up` (two engines) through loadtest/run.py, sends the same personas for
the same time, and keeps per-tenant TTFT p95 and goodput plus the KV cache service's reuse
counters (local hits, cross-instance hits, misses). The two runs are compared as ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvharbor.common.machine import auto_cpu_dtype, machine_record, machine_title

RESULTS = Path(__file__).resolve().parent / "results"
RUN = Path(__file__).resolve().parent.parent / "loadtest" / "run.py"
STRATEGIES = ("prefix", "round_robin")


def run(routing: str, out: Path, users: int, run_time: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(RUN),
        "--routing",
        routing,
        "--users",
        str(users),
        "--run-time",
        run_time,
        "--out",
        str(out),
    ]
    print(f"[platform] routing {routing}: {users} users for {run_time} ...", flush=True)
    code = subprocess.run(cmd, timeout=1800).returncode
    summary = json.loads((out / "summary.json").read_text())
    stats_path = out / "kvcache_stats.json"
    reuse = json.loads(stats_path.read_text()).get("reuse", {}) if stats_path.exists() else {}
    return {"exit_code": code, "summary": summary["summary"], "slo_misses": summary["slo_misses"], "reuse": reuse}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = sorted(result["runs"]["prefix"]["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.4
    for i, name in enumerate(STRATEGIES):
        s = result["runs"][name]["summary"]
        xs = [x + i * width for x in range(len(tenants))]
        axes[0].bar(xs, [s[t]["ttft_p95_ms"] or 0 for t in tenants], width=width, label=name)
        axes[1].bar(xs, [s[t]["goodput_rps"] for t in tenants], width=width, label=name)
    for ax, title in ((axes[0], "TTFT p95 (ms)"), (axes[1], "goodput (requests / s within SLO)")):
        ax.set_xticks([x + width / 2 for x in range(len(tenants))], tenants)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(
        "kvharbor up (2 engines), load-test personas: prefix routing vs round robin — "
        + machine_title(result["machine"]["dtype"])
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--run-time", default="90s")
    ap.add_argument("--out", type=Path, default=RESULTS / "platform.json")
    args = ap.parse_args(argv)
    result: dict = {"benchmark": "platform", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "config": {"users": args.users, "run_time": args.run_time},
                    "machine": machine_record(auto_cpu_dtype()),  # `kvharbor up`'s engines run its default dtype
                    "runs": {}}  # fmt: skip
    for name in STRATEGIES:
        result["runs"][name] = run(name, RESULTS / "platform" / name, args.users, args.run_time)
    print(f"\n{'tenant':<8}{'routing':<13}{'TTFT p95':>10}{'goodput/s':>11}")
    for tenant in sorted(result["runs"]["prefix"]["summary"]):
        for name in STRATEGIES:
            s = result["runs"][name]["summary"][tenant]
            p95 = "-" if s["ttft_p95_ms"] is None else f"{s['ttft_p95_ms']:.0f}"
            print(f"{tenant:<8}{name:<13}{p95:>10}{s['goodput_rps']:>11.2f}")
    for name in STRATEGIES:
        for model, counters in result["runs"][name]["reuse"].items():
            keep = {
                k: counters[k]
                for k in ("requests_local", "requests_shared", "requests_miss", "blocks_shared", "bytes_pulled")
            }
            print(f"reuse ({name}, {model}): {keep}")
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
