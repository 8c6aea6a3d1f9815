"""benchmarks/families.py's own parts: its arguments and the table it prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import families


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--families", "llama,falcon"], "--families: unknown falcon"),
        (["--families", ","], "(none given)"),
        (["--prompt-len", "64", "--output-len", "32"], "must pass the 128-token window"),
        (["--llama-server", "/nonexistent/llama-server"], "no such file"),
    ],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        families.parse_args(argv)
    assert match in capsys.readouterr().err


def test_every_family_the_engine_runs_is_measured():
    from kvharbor.engine.model.arch import SUPPORTED_ARCHITECTURES

    assert families.parse_args([]).families == list(families.FAMILIES)
    measured = {"llama", "gemma3_text", *families.RANDOM_FAMILIES}
    assert set(SUPPORTED_ARCHITECTURES) - measured == {"qwen2"}  # qwen2 is qwen3 less the q/k norms


def test_the_table_has_a_row_per_family_and_the_served_peers():
    run = {"kvharbor_tok_s": 30.0, "transformers_tok_s": 10.0, "ratio": 3.0, "itl_p50_s": 0.03}
    rows = [{"family": "qwen3", "architecture": "qwen3", "weight_bytes": 538e6, "c1": run, "c8": run}]
    served = {"llama-server": {f"c{c}": {"output_tok_s": 40.0, "ttft_p50_s": 0.2} for c in families.LEVELS}}
    text = families.table(rows, served)
    assert "| qwen3 | qwen3 | 538 | 30.0 | 10.0 | 3.00x | 30.0 | 10.0 | 3.00x |" in text
    assert "| llama-server | 40.0 | 200 | 40.0 | 200 |" in text
