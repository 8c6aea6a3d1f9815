"""`make loadtest`: a bounded, headless Locust run of the personas against the platform, judged
against per-tenant SLOs, with a report people can read.

    python loadtest/run.py                          # starts `kvharbor up` itself, runs 60 s
    python loadtest/run.py --host http://127.0.0.1:8000 --users 8 --run-time 2m
    python loadtest/run.py --report-only loadtest/results/latest --slos other.yaml   # re-judge

Writes into --out: Locust's CSV and HTML, requests.jsonl (one line per request), summary.json,
report.png (TTFT/ITL percentiles and throughput over time, per tenant) and, when it started the
platform, kvcache_stats.json (the KV cache service's reuse figures). Exits 1 when an SLO is
missed, naming it; 2 when the run itself could not happen.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from kvharbor.common.model_files import DEFAULT_MODEL_NAME, resolve_model
from kvharbor.launch.loadtest_tenants import LOADTEST_TENANTS as TENANTS

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# -- running -----------------------------------------------------------------------------------------


class Platform:
    """`kvharbor up` in the background, for runs without --host."""

    def __init__(self, out: Path, engines: int, routing: str, model_path: str | None) -> None:
        from kvharbor.launch.embedded_redis import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = out / "platform.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        # 384 blocks of 16 tokens per engine, in whatever dtype this CPU runs.
        # Its own admin port too: a `make up` already running holds the default 9090.
        cmd = [sys.executable, "-m", "kvharbor.launch.cli", "up", "--port", str(self.port), "--engines", str(engines),
               "--admin-port", str(free_port()), "--routing", routing, "--loadtest-tenants",
               "--num-kv-blocks", "384"]  # fmt: skip
        if model_path:
            cmd += ["--model", model_path]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 400) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvharbor up exited with {self.proc.returncode}; see {self.log_path}")
            if "ready. Try:" in self.log_path.read_text():
                return
            time.sleep(1)
        raise TimeoutError(f"the platform was not ready after {timeout:.0f}s; see {self.log_path}")

    def kvcache_stats(self) -> dict | None:
        """The KV cache service's /stats (reuse across instances), found from `up`'s status table."""
        import httpx

        for line in self.log_path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[0] == "kvcache" and parts[2].isdigit():
                try:
                    return httpx.get(f"http://127.0.0.1:{parts[2]}/stats", timeout=5).json()
                except httpx.HTTPError:
                    return None
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class KeysRefused(RuntimeError):
    """The platform does not know the load test's tenants: there is nothing to measure."""


HOW_TO_LOAD_KEYS = (
    "start the platform with `make up` (or `kvharbor up --loadtest-tenants`), which loads the load test's "
    "tenants (kvharbor.launch.loadtest_tenants); or add them to your gateway's tenants file; or run "
    "`make loadtest` without HOST, and it starts a platform of its own"
)


def check_keys(host: str) -> None:
    """Ask the gateway's /v1/models once per persona key before any load; raises KeysRefused on a 401."""
    import httpx

    for tenant, (key, _priority) in TENANTS.items():
        try:
            resp = httpx.get(f"{host}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot reach the platform at {host}: {exc}; is it running?") from None
        if resp.status_code == 401:
            raise KeysRefused(f"the gateway at {host} refused the {tenant!r} tenant's API key (401): "
                              f"{HOW_TO_LOAD_KEYS}")  # fmt: skip


def refused_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["status"] == 401]


def run_locust(host: str, out: Path, users: int, spawn_rate: float, run_time: str, model: str) -> int:
    env = {**os.environ, "KVHARBOR_LOADTEST_RECORDS": str(out / "requests.jsonl"), "KVHARBOR_LOADTEST_MODEL": model,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "--host", host,
           "-u", str(users), "-r", str(spawn_rate), "-t", run_time, "--stop-timeout", "20",
           "--csv", str(out / "locust"), "--html", str(out / "locust.html"), "--only-summary",
           "--exit-code-on-error", "0"]  # fmt: skip
    seconds = _seconds(run_time)
    print(f"[loadtest] {users} users for {run_time} against {host} ...", flush=True)
    with open(out / "locust.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=seconds + 180)
    return proc.returncode


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


# -- judging -----------------------------------------------------------------------------------------


def summarize(rows: list[dict], slos: dict) -> tuple[dict, list[str]]:
    """Per-tenant figures, and the SLOs they miss (as sentences)."""
    if not rows:
        return {}, ["no requests were recorded"]
    t0, t1 = min(r["t"] for r in rows), max(r["t"] for r in rows)
    duration = max(1.0, t1 - t0)
    summary, misses = {}, []
    for tenant in sorted({r["tenant"] for r in rows} | set(slos)):
        mine = [r for r in rows if r["tenant"] == tenant]
        slo = slos.get(tenant, {})
        sheddable = TENANTS.get(tenant, ("", 0))[1] < 0
        ok = [r for r in mine if r["ok"]]
        ttft = [r["ttft_ms"] for r in ok]
        itl = [g for r in ok for g in r["itl_ms"]]
        rejected: dict[str, int] = {}
        for r in mine:
            if not r["ok"]:
                reason = r.get("reason") or str(r["status"])
                rejected[reason] = rejected.get(reason, 0) + 1
        errors = [r for r in mine if not r["ok"] and not (sheddable and r["status"] in (429, 503))]
        good = [r for r in ok if r["ttft_ms"] <= slo.get("ttft_p95_ms", float("inf"))
                and (pct(r["itl_ms"], 95) or 0) <= slo.get("itl_p95_ms", float("inf"))]  # fmt: skip
        s = {
            "requests": len(mine),
            "ok": len(ok),
            "ttft_p50_ms": pct(ttft, 50),
            "ttft_p95_ms": pct(ttft, 95),
            "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50),
            "itl_p95_ms": pct(itl, 95),
            "goodput_rps": len(good) / duration,
            "error_rate": len(errors) / len(mine) if mine else 0.0,
            "rejections": rejected,
        }
        summary[tenant] = s
        misses += _misses(tenant, s, slo)
    return summary, misses


def _misses(tenant: str, s: dict, slo: dict) -> list[str]:
    out = []
    if not s["requests"]:
        return [f"{tenant}: no requests were made"]
    for key, label in (("ttft_p95_ms", "TTFT p95"), ("itl_p95_ms", "ITL p95")):
        if key in slo and (s[key] is None or s[key] > slo[key]):
            got = "no data" if s[key] is None else f"{s[key]:.0f} ms"
            out.append(f"{tenant}: {label} {got} > {slo[key]} ms")
    if "max_error_rate" in slo and s["error_rate"] > slo["max_error_rate"]:
        out.append(f"{tenant}: error rate {s['error_rate']:.1%} > {slo['max_error_rate']:.1%}")
    if "min_goodput_rps" in slo and s["goodput_rps"] < slo["min_goodput_rps"]:
        out.append(f"{tenant}: goodput {s['goodput_rps']:.2f} req/s < {slo['min_goodput_rps']} req/s")
    return out


def print_table(summary: dict) -> None:
    def ms(v):
        return "-" if v is None else f"{v:.0f}"

    head = f"{'tenant':<8}{'reqs':>6}{'ok':>6}{'TTFT p50':>10}{'p95':>7}{'p99':>7}{'ITL p50':>9}{'p95':>6}"
    print(f"\n{head}{'goodput/s':>11}  rejections")
    for tenant, s in summary.items():
        rejected = ", ".join(f"{k}={v}" for k, v in sorted(s["rejections"].items())) or "-"
        ttft = f"{ms(s['ttft_p50_ms']):>10}{ms(s['ttft_p95_ms']):>7}{ms(s['ttft_p99_ms']):>7}"
        itl = f"{ms(s['itl_p50_ms']):>9}{ms(s['itl_p95_ms']):>6}"
        print(f"{tenant:<8}{s['requests']:>6}{s['ok']:>6}{ttft}{itl}{s['goodput_rps']:>11.2f}  {rejected}")


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenants = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    for ax, keys, title in (
        (axes[0], ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms"), "TTFT percentiles (ms)"),
        (axes[1], ("itl_p50_ms", "itl_p95_ms"), "inter-token latency percentiles (ms)"),
    ):
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            ax.bar([x + i * width for x in range(len(tenants))], [summary[t][key] or 0 for t in tenants], width=width,
                   label=key.split("_")[1])  # fmt: skip
        ax.set_xticks([x + width * (len(keys) - 1) / 2 for x in range(len(tenants))], tenants)
        ax.set_title(title)
        ax.legend()
    t0 = min(r["t"] for r in rows)
    for tenant in tenants:
        done = sorted(r["t"] - t0 for r in rows if r["tenant"] == tenant and r["ok"])
        buckets = [0] * (int(max(done, default=0) // 5) + 1)
        for t in done:
            buckets[int(t // 5)] += 1
        axes[2].plot([5 * i for i in range(len(buckets))], [b / 5 for b in buckets], marker="o", label=tenant)
    axes[2].set_title("completed requests / s over time (5 s buckets)")
    axes[2].set_xlabel("seconds")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(out: Path, slos_path: Path) -> int:
    records = out / "requests.jsonl"
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()] if records.exists() else []
    if refused := refused_rows(rows):
        # Keys taken away mid-run (a tenants file edited): no verdict on SLOs for a run that never ran.
        print(f"[loadtest] error: {len(refused)} requests were refused with 401: {HOW_TO_LOAD_KEYS}", file=sys.stderr)
        return 2
    slos = (yaml.safe_load(slos_path.read_text()) or {}).get("tenants", {})
    summary, misses = summarize(rows, slos)
    (out / "summary.json").write_text(json.dumps({"summary": summary, "slo_misses": misses, "slos": slos}, indent=1))
    if rows:
        print_table(summary)
        plot(rows, summary, out / "report.png")
    print(f"\n[loadtest] report: {out / 'summary.json'}, {out / 'report.png'}, {out / 'locust.html'}")
    if misses:
        print("[loadtest] SLOs missed:\n  " + "\n  ".join(misses))
        return 1
    print("[loadtest] every SLO met")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", help="platform URL (default: start `kvharbor up` for the run)")
    ap.add_argument("--users", type=int, default=6, help="concurrent simulated users (bounded)")
    ap.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second")
    ap.add_argument("--run-time", default="60s", help="how long to run, e.g. 30s, 2m (bounded)")
    ap.add_argument("--slos", type=Path, default=HERE / "slos.yaml", help="per-tenant SLO file")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "latest", help="report directory")
    ap.add_argument("--engines", type=int, default=2, help="engines, when this run starts the platform")
    ap.add_argument("--routing", default="prefix", help="routing, when this run starts the platform")
    ap.add_argument("--model", help="model id the personas ask for (default: what --model-path serves, or SmolLM2)")
    ap.add_argument("--model-path", help="model file or folder, when this run starts the platform (default: SmolLM2)")
    ap.add_argument("--report-only", type=Path, help="judge an earlier run's directory again (no traffic)")
    args = ap.parse_args(argv)
    if args.users < 1 or args.users > 200 or _seconds(args.run_time) > 3600:
        ap.error("keep runs bounded: 1-200 users and at most 1h")
    if args.report_only:
        return report(args.report_only, args.slos)
    if args.host and not args.host.startswith(("http://127.", "http://localhost")):
        ap.error("load runs talk to loopback only: --host http://127.0.0.1:PORT")
    if args.host and args.model_path:
        ap.error("--model-path is for a platform this run starts; with --host, name the served model with --model")
    try:
        served = resolve_model(args.model_path)[1] if args.model_path else DEFAULT_MODEL_NAME
    except FileNotFoundError as exc:
        ap.error(str(exc))
    model = args.model or served
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "requests.jsonl").unlink(missing_ok=True)
    platform = None
    try:
        host = args.host
        if host is None:
            print(f"[loadtest] starting the platform ({args.engines} engines, routing {args.routing}) ...", flush=True)
            platform = Platform(args.out, args.engines, args.routing, args.model_path)
            platform.wait_ready()
            host = platform.url
        check_keys(host)
        run_locust(host, args.out, args.users, args.spawn_rate, args.run_time, model)
        if platform is not None and (stats := platform.kvcache_stats()) is not None:
            (args.out / "kvcache_stats.json").write_text(json.dumps(stats, indent=1))
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"[loadtest] error: {exc}", file=sys.stderr)
        return 2
    finally:
        if platform is not None:
            platform.stop()
    return report(args.out, args.slos)


if __name__ == "__main__":
    sys.exit(main())
