"""benchmarks/int_dot.py: both builds are timed on every format and row count, and the report says
which VNNI this CPU compiled and where it ran; bad arguments are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import int_dot

from kvharbor.common.machine import cpu_info
from kvharbor.engine.cpu import cpu_kernels


@pytest.mark.slow  # compiles the kernel twice, ~10 s each here
def test_int_dot_times_both_builds_or_says_why_not(tmp_path, capsys):
    out = tmp_path / "int_dot.json"
    code = int_dot.main(["--rows", "1", "3", "--layers", "1", "--rounds", "1", "--out", str(out)])
    if not cpu_kernels.vnni_flags(cpu_info()) or cpu_kernels._compiler() is None:
        assert code == 2 and "no VNNI" in capsys.readouterr().err and not out.exists()
        return
    assert code == 0
    record = json.loads(out.read_text())
    assert record["vnni"] in ("avx_vnni", "avx512_vnni") and record["machine"]["dtype"] == "float32"
    assert [(r["mode"], r["rows"]) for r in record["results"]] == [
        (mode, rows) for mode in int_dot.MODES for rows in (1, 3)
    ]
    for r in record["results"]:
        assert r["maddubs_ms"] > 0 and r["vnni_ms"] > 0
        assert r["speedup"] == pytest.approx(r["maddubs_ms"] / r["vnni_ms"])
    assert "speed-up" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "33"], ["--layers", "0"], ["--rounds", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        int_dot.main(argv)
    assert "--rows must be" in capsys.readouterr().err
