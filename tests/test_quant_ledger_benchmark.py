"""benchmarks/quant_ledger.py's own parts: arguments, the peak-RSS reading of a process tree, and
the rows it reports (ratios to `none`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import quant_ledger


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--modes", "int3"], "--modes: unknown mode 'int3'"),
        (["--modes", "int8+int4"], "--modes: unknown mode 'int8+int4'"),
        (["--llama-server", "x", "--peer-url", "http://127.0.0.1:1"], "not both"),
        (["--peer-url", "http://example.com:8080"], "on this machine"),
    ],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        quant_ledger.parse_args(argv)
    assert match in capsys.readouterr().err


def test_none_is_always_measured_first():
    assert quant_ledger.parse_args(["--modes", "gguf,int8"]).modes == ["none", "gguf", "int8"]
    assert quant_ledger.quality.mode_options("gguf+kv-int8") == {"quantization": "gguf", "kv_cache_dtype": "int8"}


@pytest.mark.slow  # starts two processes
def test_peak_rss_counts_the_children_of_a_process():
    # 200 MiB written in the parent, 300 in its child; both wait on the test's pipe, and end at its EOF.
    child = "import sys; x = b'c' * (300 * 2**20); print('up', flush=True); sys.stdin.read()"
    code = (f"import subprocess, sys; x = b'p' * (200 * 2**20); "
            f"subprocess.run([sys.executable, '-c', {child!r}])")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "up\n"
        assert quant_ledger.peak_rss(parent.pid) >= 500 * 2**20
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
    assert quant_ledger.peak_rss(parent.pid) == 0  # gone: nothing to read


def test_rows_carry_ratios_to_none():
    def result(c1: float, c8: float) -> dict:
        latency = {"ttft_p50_s": 0.1, "ttft_p95_s": 0.2, "itl_p50_s": 0.01, "itl_p95_s": 0.02}
        runs = [{"concurrency": c, "summary": {"output_tok_s": v, **latency}} for c, v in ((1, c1), (8, c8))]
        return {"runs": runs, "peak_rss_bytes": 2**28, "weight_bytes": 2**26, "kv_bytes_per_token": 100}

    results = {"none": result(10, 40), "gguf+kv-int8": result(15, 60), "llama-server": result(20, 30)}
    ledgers = {
        "none": {"mean_kl": 0.0, "top1_agreement": 1.0},
        "gguf+kv-int8": {"mean_kl": 0.002, "top1_agreement": 0.98},
    }
    base, row, peer = quant_ledger.report_rows(results, ledgers, [1, 8])
    assert row["label"] == "kvharbor gguf+kv-int8" and row["quality"]["mean_kl"] == 0.002
    assert row["c1"]["tok_s_ratio"] == 1.5 and row["c8"]["tok_s_ratio"] == 1.5
    assert row["vs_llama_server"] == {"c1": 0.75, "c8": 2.0}
    assert base["c1"]["tok_s_ratio"] == 1.0 and "vs_llama_server" not in base and peer["quality"] is None
    text = quant_ledger.table([base, row, peer], [1, 8])
    assert "kvharbor gguf+kv-int8" in text and "1.50" in text and "256" in text  # peak RSS in MiB


def test_quality_read_from_a_file_says_when_and_where_it_was_measured(tmp_path):
    import json
    from types import SimpleNamespace

    from kvharbor.common.machine import machine_record

    row = {"mode": "int8", **{k: 0.5 for k in quant_ledger.QUALITY_KEYS}}
    other = {**machine_record(), "cpu_model": "Another CPU"}
    for machine, same in ((machine_record(), True), (other, False)):
        path = tmp_path / f"quality-{same}.json"
        path.write_text(json.dumps({"when": "2026-12-01T19:55:12", "machine": machine, "rows": [row]}))
        ledgers, source = quant_ledger.quality_rows(SimpleNamespace(quality_json=path), ["int8"])
        assert ledgers == {"int8": {k: 0.5 for k in quant_ledger.QUALITY_KEYS}}
        assert source["same_cpu"] is same and not source["ran_here"]
        note = quant_ledger.quality_note(source)
        assert str(path) in note and "2026-12-01T19:55:12" in note
        assert ("NOT this machine's CPU" in note) is not same


def test_a_run_with_its_own_out_writes_its_quality_ledger_beside_it(tmp_path):
    """Only the default report writes results/quality.json: another --out's run left the shared file
    overwritten with its own modes alone."""
    results = quant_ledger.RESULTS
    assert quant_ledger.quality_path(results / "quant_ledger.json") == results / "quality.json"
    assert quant_ledger.quality_path(tmp_path / "quant_ledger_gguf_llama.json") == (
        tmp_path / "quant_ledger_gguf_llama_quality.json"
    )
