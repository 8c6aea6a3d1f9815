"""The five ledgers of every weight-quantization mode, served, in one report: workload, latency,
throughput, memory and quality, each mode against kvharbor's `none` measured in the same run, and
`gguf` against llama.cpp's llama-server serving the same GGUF file.

For each mode, `kvharbor serve --dtype float32 --quantization MODE` is started, measured with
benchmarks/serve.py (the compare_peers.py workload: NUM_REQUESTS streamed completions of
PROMPT_LEN random-token prompts and OUTPUT_LEN tokens each, at each concurrency) and stopped
before the next starts. Then, with --llama-server BIN, llama-server on the bundled GGUF with the
same threads and slots as the concurrency needs; or, with --peer-url, a llama-server already
running (its memory is then not known).

- workload: the prompt and output lengths and concurrencies, as sent;
- latency: TTFT and ITL at p50 and p95;
- throughput: output tok/s at each concurrency, and as a ratio to `none`;
- memory: weight bytes and KV bytes per token (the engine's /load; modes may set the KV dtype,
  e.g. kv-int8 or gguf+kv-int8), the server's peak RSS (the
  VmHWM of the API server plus its engine core process, read from /proc before it stops);
- quality: benchmarks/quality.py's columns for the same modes (run as a subprocess first, or read
  from --quality-json: the report then says when and on which CPU they were measured, and
  whether that is this machine's).

    python benchmarks/quant_ledger.py [--modes none,int8,int4,gguf,kv-int8] [--llama-server /path/to/llama-server]

Prints a table, writes benchmarks/results/quant_ledger.{json,png}. Build llama-server as
benchmarks/README.md says (from the llama.cpp sources vendored in llama-cpp-python's sdist, in a
scratch folder outside the repository).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_peers
import quality

from kvharbor.common.machine import machine_record, machine_title
from kvharbor.common.model_files import default_model_path
from kvharbor.launch.embedded_redis import free_port

RESULTS = Path(__file__).resolve().parent / "results"
QUALITY_KEYS = ("mean_kl", "p99_kl", "top1_agreement", "ppl_ratio", "greedy_match_mean")


def peak_rss(pid: int) -> int:
    """Sum of VmHWM (peak resident set) of `pid` and every process under it, in bytes."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue  # gone already
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    return total


def serve_kvharbor(mode: str, args: argparse.Namespace, logs: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = quality.mode_options(mode)
    flags = ["--quantization", options.get("quantization", "none"),
             "--kv-cache-dtype", options.get("kv_cache_dtype", "auto")]  # fmt: skip
    cmd = [sys.executable, "-m", "kvharbor.launch.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--dtype", "float32", *flags, "--num-kv-blocks", str(args.kv_blocks), "--max-model-len", "2048"]  # fmt: skip
    print(f"kvharbor serve {' '.join(flags)} ...", file=sys.stderr)
    with compare_peers.server(cmd, url, "/ready", logs / f"quant-{mode}.log", {}, 600) as proc:
        load = httpx.get(url + "/load", timeout=10).json()
        result = compare_peers.measure(f"kvharbor-{mode}", url, args)
        result["peak_rss_bytes"] = peak_rss(proc.pid)
    result.update(weight_bytes=load["weight_bytes"], kv_bytes_per_token=load["kv_bytes_per_token"])
    return result


def serve_llama(args: argparse.Namespace, logs: Path) -> dict:
    if args.peer_url:
        return {**compare_peers.measure("llama-server", args.peer_url, args), "peak_rss_bytes": None}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    slots = max(int(c) for c in args.concurrency.split(","))
    # -c is the context of all slots together; -t / -tb both cores, as kvharbor gets them.
    cmd = [args.llama_server, "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2",
           "-tb", "2", "-np", str(slots), "-c", str(2048 * slots), "--alias", compare_peers.MODEL,
           "-ngl", "0"]  # fmt: skip
    print("llama-server ...", file=sys.stderr)
    with compare_peers.server(cmd, url, "/health", logs / "llama-server.log", {}, 300) as proc:
        result = compare_peers.measure("llama-server", url, args)
        result["peak_rss_bytes"] = peak_rss(proc.pid)
    return result


def quality_rows(args: argparse.Namespace, modes: list[str]) -> tuple[dict[str, dict], dict]:
    """Each mode's quality columns, and where they come from: this run, or --quality-json's file
    (its time and machine, and whether that machine's CPU is this one's: the report says so)."""
    path = args.quality_json
    if path is None:  # beside --out: a run with its own --out leaves results/quality.json alone
        path = quality_path(args.out)
        lossy = ",".join(modes)
        cmd = [sys.executable, str(Path(__file__).with_name("quality.py")), "--modes", lossy, "--out", str(path)]
        print("quality ledger (benchmarks/quality.py) ...", file=sys.stderr)
        subprocess.run(cmd, check=True)
    report = json.loads(Path(path).read_text())
    machine = report.get("machine") or {}
    source = {"path": str(path), "ran_here": args.quality_json is None, "when": report.get("when"),
              "machine": machine, "same_cpu": same_cpu(machine, machine_record())}  # fmt: skip
    return {r["mode"]: {k: r[k] for k in QUALITY_KEYS} for r in report["rows"]}, source


def quality_path(out: Path) -> Path:
    """Where a run writes the quality ledger it measures: quality.json beside the default report,
    else <out's stem>_quality.json."""
    return out.with_name("quality.json" if out.name == "quant_ledger.json" else f"{out.stem}_quality.json")


def same_cpu(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("cpu_model", "arch", "cores", "isa"))


def quality_note(source: dict) -> str:
    if source["ran_here"]:
        return "quality columns: measured in this run"
    m = source["machine"]
    where = f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores" if m else "an unrecorded machine"
    flags = ", ".join(k for k, v in (m.get("isa") or {}).items() if v) or "no flags recorded"
    other = "" if source["same_cpu"] else " (NOT this machine's CPU: KL and top-1 can differ with the kernels it takes)"
    return f"quality columns: from {source['path']}, measured {source['when'] or '?'} on {where} ({flags}){other}"


def summary_row(label: str, result: dict, base: dict | None) -> dict:
    runs = {r["concurrency"]: r["summary"] for r in result["runs"]}
    row = {"label": label, **{k: result.get(k) for k in ("peak_rss_bytes", "weight_bytes", "kv_bytes_per_token")}}
    for c, s in runs.items():
        row[f"c{c}"] = {k: s[k] for k in ("output_tok_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s")}
        if base is not None:
            row[f"c{c}"]["tok_s_ratio"] = s["output_tok_s"] / base[f"c{c}"]["output_tok_s"]
    return row


def report_rows(results: dict[str, dict], ledgers: dict[str, dict], levels: list[int]) -> list[dict]:
    """One row per server (`none` first: every ratio's base), with its quality columns, and for
    gguf modes the ratio to llama-server's output tok/s at each concurrency."""
    base = summary_row("none", results["none"], None)
    rows = [summary_row(f"kvharbor {m}" if m != "llama-server" else m, r, base) for m, r in results.items()]
    for row, mode in zip(rows, results, strict=True):
        row["quality"] = ledgers.get(mode)
    if "llama-server" in results:
        peer = rows[-1]
        for mode, row in zip(results, rows, strict=True):
            if mode != "llama-server" and quality.mode_options(mode).get("quantization") == "gguf":
                row["vs_llama_server"] = {f"c{c}": row[f"c{c}"]["output_tok_s"] / peer[f"c{c}"]["output_tok_s"]
                                          for c in levels}  # fmt: skip
    return rows


def table(rows: list[dict], levels: list[int]) -> str:
    head = f"{'server':<22}"
    for c in levels:
        head += f"{f'c={c} tok/s':>12}{'x none':>8}{'TTFT p50/p95 ms':>17}{'ITL p50/p95 ms':>16}"
    head += f"{'weights MiB':>13}{'KV B/tok':>10}{'peak RSS MiB':>14}{'mean KL':>10}{'top-1':>8}"
    lines = [head]
    for r in rows:
        line = f"{r['label']:<22}"
        for c in levels:
            s = r[f"c{c}"]
            ratio = f"{s['tok_s_ratio']:.2f}" if "tok_s_ratio" in s else "-"
            line += (f"{s['output_tok_s']:>12.1f}{ratio:>8}{s['ttft_p50_s'] * 1e3:>9.0f}/{s['ttft_p95_s'] * 1e3:<7.0f}"
                     f"{s['itl_p50_s'] * 1e3:>8.1f}/{s['itl_p95_s'] * 1e3:<7.1f}")  # fmt: skip
        mib = lambda v: f"{v / 2**20:.0f}" if v else "-"  # noqa: E731
        q = r.get("quality") or {}
        kl = f"{q['mean_kl']:.5f}" if q else "-"
        top1 = f"{q['top1_agreement']:.1%}" if q else "-"
        line += f"{mib(r['weight_bytes']):>13}{r['kv_bytes_per_token'] or '-':>10}{mib(r['peak_rss_bytes']):>14}"
        line += f"{kl:>10}{top1:>8}"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], levels: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    placed: list[tuple[float, float]] = []  # labelled points, to step a near one's label down
    for r in rows:
        kl = max((r.get("quality") or {}).get("mean_kl", 1e-7), 1e-7)
        for c, marker in zip(levels, "os^", strict=False):
            tok_s = r[f"c{c}"]["output_tok_s"]
            speed.scatter(kl, tok_s, marker=marker)
            near = sum(abs(math.log10(kl / k)) < 0.6 and abs(tok_s - t) < 0.06 * max(t, 1) for k, t in placed)
            placed.append((kl, tok_s))
            speed.annotate(f"{r['label']} c={c}", (kl, tok_s), xytext=(4, 2 - 9 * near), textcoords="offset points",
                           fontsize=8)  # fmt: skip
    speed.set_xscale("log")
    speed.set_xlabel("mean KL per token vs float32 (nats, log; peers and none at the left edge)")
    speed.set_ylabel("served output tok/s")
    labels = [r["label"].removeprefix("kvharbor ") for r in rows]
    memory.bar(labels, [(r["peak_rss_bytes"] or 0) / 2**20 for r in rows], label="peak RSS (server + core)")
    memory.bar(labels, [(r["weight_bytes"] or 0) / 2**20 for r in rows], label="weights", width=0.4)
    memory.set_ylabel("MiB")
    memory.legend()
    memory.tick_params(axis="x", labelsize=8, labelrotation=30)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,int8,int4,gguf,kv-int8", help=f"comma-separated; each {quality.MODE_HELP}")
    ap.add_argument("--llama-server", help="a llama-server binary to start on the bundled GGUF (the gguf peer)")
    ap.add_argument("--peer-url", help="a llama-server already serving the same GGUF, instead of starting one")
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF for llama-server (default: the bundled one)")
    ap.add_argument("--quality-json", type=Path, help="benchmarks/quality.py's output to use instead of running it")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-blocks", type=int, default=512, help="KV pool of each kvharbor server, in 16-token blocks")
    ap.add_argument("--out", type=Path, default=RESULTS / "quant_ledger.json")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        for m in modes or ["(none given)"]:
            quality.mode_options(m)
    except ValueError as exc:
        ap.error(f"--modes: {exc}")
    if args.llama_server and args.peer_url:
        ap.error("give --llama-server or --peer-url, not both")
    if args.peer_url and not args.peer_url.startswith(("http://127.0.0.1", "http://localhost")):
        ap.error("--peer-url must be on this machine (http://127.0.0.1:PORT)")
    args.modes = ["none", *[m for m in modes if m != "none"]]  # none is every ratio's base
    args.gguf = args.gguf or default_model_path()
    args.dtype, args.shared_prefix = "float32", "0"  # compare_peers.measure's fields
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    ledgers, quality_source = quality_rows(args, args.modes)
    results = {m: serve_kvharbor(m, args, logs) for m in args.modes}
    if args.llama_server or args.peer_url:
        results["llama-server"] = serve_llama(args, logs)
    rows = report_rows(results, ledgers, levels)
    title = (f"SmolLM2-135M, {args.num_requests} requests x {args.prompt_len} prompt / {args.output_len} output "
             f"tokens — {machine_title('float32')}")  # fmt: skip
    print(title)
    print(table(rows, levels))
    print(quality_note(quality_source))
    for r in rows:
        if "vs_llama_server" in r:
            print(
                "kvharbor gguf / llama-server output tok/s: "
                + ", ".join(f"{k} {v:.2f}x" for k, v in r["vs_llama_server"].items())
            )
    report = {"benchmark": "quant_ledger", "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "machine": machine_record("float32"),
              "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                           "output_len": args.output_len, "concurrency": levels, "shared_prefix": 0,
                           "prompts": "random token ids (benchmarks/serve.py), ignore_eos, temperature 0"},
              "quality_source": quality_source, "rows": rows, "runs": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    plot(rows, levels, args.out.with_suffix(".png"), title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
