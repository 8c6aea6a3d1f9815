"""benchmarks/roofline.py: the machine's limits are probed, every linear is set against the limit
that binds it, the decode step against its weights' read time, and bad arguments are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import roofline

from kvharbor.engine.cpu import cpu_kernels


@pytest.mark.slow  # compiles the probes (cc), loads SmolLM2 and times it
def test_the_report_sets_each_kernel_against_its_binding_limit(tmp_path, capsys):
    if cpu_kernels._compiler() is None:
        pytest.skip("no C compiler: the probes cannot be built")
    out = tmp_path / "roofline.json"
    argv = ["--rows", "1", "128", "--shapes", "kv", "--rounds", "3", "--decode-steps", "3", "--prompt", "64",
            "--context", "64", "--out", str(out)]
    assert roofline.main(argv) == 0
    record = json.loads(out.read_text())
    limits = record["limits"]
    assert "avx2_fma" in limits["peaks_flops"] and limits["read_bytes_per_s"] > 0
    assert limits["float32_peak_flops"] == max(v for k, v in limits["peaks_flops"].items() if k.endswith("_fma"))
    kernels = {r["kernel"] for r in record["linears"]}
    assert {"torch float32", "torch bfloat16", "kvharbor packed float32"} <= kernels
    packs = cpu_kernels.load(2) is not None and cpu_kernels.load(2).int_packs()
    assert ("kvharbor packed int q4" in kernels) == packs == (limits["int16x_peak_flops"] is not None)
    assert [(r["rows"]) for r in record["linears"]] == [1] * len(kernels) + [128] * len(kernels)
    binding = {"torch bfloat16": "bfloat16", "kvharbor packed int q4": "int16x"}  # the rest: float32
    for r in record["linears"]:
        peak = limits[f"{binding.get(r['kernel'], 'float32')}_peak_flops"]
        flops = 2 * r["rows"] * r["n"] * r["k"]
        memory_s, compute_s = flops / r["intensity"] / limits["read_bytes_per_s"], flops / peak
        assert r["bound"] == ("compute" if compute_s >= memory_s else "memory")
        assert r["of_roofline"] == pytest.approx(max(memory_s, compute_s) / r["seconds"])
        # Nothing beats the machine: a probe that measured too little (its accumulators spilled to
        # the stack once, half the rate) shows as kernels far past 100%. 1.5 leaves room for noise.
        assert 0 < r["of_roofline"] < 1.5, r
    prefill, decode_rows = record["attention"]  # small here: only their shape and arithmetic are checked
    assert prefill["shape"] == "prefill 64" and prefill["bound"] == "compute" and decode_rows["rows"] == 8
    assert prefill["gflops"] == pytest.approx(4 * 64 * (64 * 65 / 2 * 9) / prefill["seconds"] / 1e9)
    assert all(r["of_roofline"] > 0 for r in record["attention"])
    decode = record["decode"]
    assert decode["batch_invariant"] and decode["requests"] == 8
    assert decode["of_bandwidth_bound"] == pytest.approx(decode["bound_seconds"] / decode["step_seconds"])
    assert 0 < decode["of_bandwidth_bound"] < 1.5
    assert record["machine"]["cores"] >= 1 and out.with_suffix(".png").stat().st_size > 0
    assert "of roofline" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rounds", "0"], ["--shapes", "nope"], ["--threads", "0"],
                                  ["--prompt", "8"], ["--context", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        roofline.main(argv)
    assert "error" in capsys.readouterr().err
