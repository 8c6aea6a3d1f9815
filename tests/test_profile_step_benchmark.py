"""benchmarks/profile_step.py on a tiny model: both engines are measured, the parts add up to the
step, the timers are taken off again, and the report carries the machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import profile_step

from kvharbor.engine.model import decoder as model_module


@pytest.mark.slow  # two engines load and run, ~10 s here
def test_profile_splits_each_engines_step_and_restores_the_engine(tiny_chat_model, tmp_path, capsys):
    linear = model_module._linear
    out = tmp_path / "profile.json"
    code = profile_step.main(
        ["--model", str(tiny_chat_model), "--batch", "2", "--prompt", "20", "--output", "4", "--out", str(out)]
    )
    assert code == 0 and model_module._linear is linear  # the timers are gone
    record = json.loads(out.read_text())
    assert [r["label"] for r in record["results"]] == ["baseline", "kvharbor"]
    for r in record["results"]:
        parts = r["parts_ms"]
        assert set(parts) == set(profile_step.PARTS) and all(v >= 0 for v in parts.values())
        assert parts["linears"] > 0 and parts["attention"] > 0 and parts["lm_head"] > 0
        assert abs(sum(parts.values()) - r["step_ms"]) < 1e-6 * max(1.0, r["step_ms"])
        assert r["steps"] == 3  # 4 tokens: the prefill samples the first, 3 decode steps
    assert record["machine"]["dtype"] == "float32" and "avx2" in record["machine"]["isa"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert "linears" in capsys.readouterr().out


def test_bad_shapes_are_refused(capsys):
    with pytest.raises(SystemExit):
        profile_step.main(["--output", "1"])
    assert "--output" in capsys.readouterr().err
