"""benchmarks/quality.py on a tiny random model: `none` against the float32 reference is exactly
0 KL with full agreement, a lossy mode is not, and bad arguments are refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import quality

from kvharbor.engine.cpu.cpu_kernels import load


@pytest.mark.slow  # five engines load and run, ~14 s here
@pytest.mark.skipif(load(2) is None, reason="int8 and int4 need the AVX2 kernels")
def test_none_is_exact_and_the_lossy_modes_are_measured_as_lossy(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "quality.json"
    args = ["--model", str(tiny_chat_model), "--modes", "none,int8,int4,kv-int8", "--text-tokens", "24",
            "--decode-positions", "5", "--greedy-tokens", "6", "--speed-tokens", "3", "--out", str(out)]  # fmt: skip
    assert quality.main(args) == 0
    record = json.loads(out.read_text())
    none, int8, int4, kv = record["rows"]
    assert none["mean_kl"] == 0 and none["p99_kl"] == 0 and none["top1_agreement"] == 1 and none["ppl_ratio"] == 1
    assert none["greedy_full_matches"] == none["greedy_prompts"] == 12  # 3 system prompts x 4 questions
    assert int8["mean_kl"] > 0 and int8["p99_kl"] >= int8["mean_kl"]
    assert int4["mean_kl"] > int8["mean_kl"]  # 16 levels per group lose more than 255 per row
    assert int8["linear_weight_bytes"] < none["linear_weight_bytes"] / 3  # int8 + scales vs float32
    assert int4["linear_weight_bytes"] < none["linear_weight_bytes"] / 5  # 16 B of nibbles + 8 of scale, min per 32
    assert int4["weight_bytes"] < none["weight_bytes"]
    assert none["positions"] == int8["positions"] == int4["positions"] > 0
    assert none["decode_positions"] == 9 * 4 and none["decode_mean_kl"] == 0 and int8["decode_mean_kl"] > 0
    assert kv["mean_kl"] > 0 and kv["linear_weight_bytes"] == none["linear_weight_bytes"]  # only the KV is 8-bit
    assert kv["kv_bytes_per_token"] < none["kv_bytes_per_token"] / 3
    assert record["machine"]["dtype"] == "float32" and out.with_suffix(".png").stat().st_size > 0
    assert "mean KL" in capsys.readouterr().out


@pytest.mark.slow  # three engines and two transformers models load and run
def test_the_bfloat16_ledger_measures_the_engine_and_transformers_alike(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "quality.json"
    args = ["--model", str(tiny_chat_model), "--modes", "bf16,bf16+kv-int8", "--hf-peers", "bf16,f32",
            "--text-tokens", "24", "--decode-positions", "5", "--greedy-tokens", "6", "--speed-tokens", "3",
            "--out", str(out)]  # fmt: skip
    assert quality.main(args) == 0
    record = json.loads(out.read_text())
    bf16, bf16_kv, hf_bf16, hf_f32 = record["rows"]
    assert [r["mode"] for r in record["rows"]] == ["bf16", "bf16+kv-int8", "hf-bf16", "hf-f32"]
    assert record["modes"]["bf16+kv-int8"] == {"dtype": "bfloat16", "kv_cache_dtype": "int8"}
    assert 0 < bf16["mean_kl"] < bf16_kv["mean_kl"]  # bfloat16 loses a little; 8-bit KV on top, more
    assert bf16_kv["kv_bytes_per_token"] < bf16["kv_bytes_per_token"]  # int8 rows and a scale, not bfloat16's
    assert hf_bf16["mean_kl"] > 0 and hf_bf16["speed_tok_s"] == {} and hf_bf16["positions"] == bf16["positions"]
    assert hf_f32["mean_kl"] < 1e-6 and hf_f32["top1_agreement"] == 1  # the reference is transformers' float32
    assert "hf-bf16" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--modes", "int3"], "unknown mode"),
        (["--modes", "bf16+bf16"], "unknown mode"),
        (["--hf-peers", "fp8"], "--hf-peers takes"),
        (["--modes", "kv-int8+kv-fp8"], "unknown mode"),
        (["--text-tokens", "1"], ">= 2"),
        (["--decode-positions", "300"], "below --text-tokens"),
    ],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        quality.main(argv)
    assert match in capsys.readouterr().err


def test_the_text_is_the_standard_librarys_own():
    texts = quality.stdlib_texts()
    assert len(texts) == len(quality.MODULES) and all(len(t) > 100 for t in texts)
    assert len(quality.chat_prompts()) == 12
