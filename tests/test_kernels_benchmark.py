"""benchmarks/gpu_kernels.py cannot run here (it needs CUDA): it must refuse clearly, and its
bookkeeping (cases, bytes, verdict) must be right for when it runs on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import gpu_kernels as kernels  # noqa: E402  (not `kernels`: transformers imports a package of that name)


@pytest.mark.slow  # runs the benchmark script
def test_refuses_without_cuda_and_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark runs instead of refusing")
    out = subprocess.run([sys.executable, str(BENCH / "gpu_kernels.py"), "--quick"], capture_output=True, text=True)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_bytes_cases_and_verdict():
    # Llama-3-8B decode, one sequence of 1024 tokens: K+V = 2 x 1024 x 8 x 128 x 2 bytes, + Q + out.
    assert kernels.decode_bytes(1, 1024) == 2 * 1024 * 8 * 128 * 2 + 2 * 32 * 128 * 2
    cases = kernels.decode_cases(quick=False)
    assert (1, 512) in cases and (256, 16384) in cases and (256, 32768) not in cases  # memory cap
    row = lambda batch, gbs, speedup: kernels.Row("decode", batch, 4096, 1, 1.0, gbs, speedup, None, speedup)  # noqa: E731
    good = kernels.verdict([row(1, 3000, 0.8), row(8, 3500, 1.5)], copy_gbs=4000)
    assert good["bandwidth_target_met"] and good["beats_gather_sdpa_from_batch_8"]
    bad = kernels.verdict([row(8, 2000, 0.9), row(64, 2500, 1.2)], copy_gbs=4000)
    assert not bad["bandwidth_target_met"] and bad["decode_cases_not_beating_baseline"] == ["b8/ctx4096"]


def test_report_and_title_name_the_machine_and_gpu():
    row = kernels.Row("decode", 8, 4096, 1, 1.0, 3500, 1.5, None, 1.5)
    report = kernels.report([row], 4000, "NVIDIA H200", "2.5.0")
    machine = report["machine"]
    assert machine["cpu_model"] and machine["cores"] >= 1 and "avx2" in machine["isa"]
    assert machine["dtype"] == "bfloat16" and machine["gpu"] == "NVIDIA H200"
    assert report["verdict"]["beats_gather_sdpa_from_batch_8"] and report["rows"][0]["batch"] == 8
    title = kernels.plot_title("NVIDIA H200")
    assert title.startswith("Triton attention kernels on NVIDIA H200 — ") and title.endswith(", bfloat16")
