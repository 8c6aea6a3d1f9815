"""`--dtype auto` and the float32 prefill kernel chosen by measurement (engine/cpu/kernel_probe.py):
the choice on faked figures (CPUs no session has seen), the figures measured here and kept for the
machine's later engines (a torn or unwritable cache costs a measurement, never a start), and an
engine that logs what it chose and why."""

from __future__ import annotations

import logging

import pytest
import torch

from kvharbor.common.machine import CpuInfo
from kvharbor.engine.cpu import cpu_kernels, kernel_probe
from kvharbor.engine.cpu.kernel_probe import Figures, choose
from kvharbor.engine.model.device import resolve_dtype

needs_kernels = pytest.mark.skipif(cpu_kernels.load(2) is None, reason="kvharbor's kernels cannot run here")


def figures(**turns: tuple[float, float]) -> Figures:
    """Faked figures: name -> (prefill s, decode s), names with spaces written with underscores."""
    named = {k.replace("_", " "): v for k, v in turns.items()}
    return Figures({k: v[0] for k, v in named.items()}, {k: v[1] for k, v in named.items()})


def test_bfloat16_is_chosen_only_where_it_saves_enough():
    # An AVX2 CPU: bfloat16 weights halve the bytes a decode step reads, the same prefill.
    avx2 = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.010, 0.002))
    assert choose(avx2, invariant=True).dtype == "bfloat16"
    # A CPU where widening bfloat16 costs: 5% faster is not worth its accuracy.
    close = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.010, 0.0038))
    got = choose(close, invariant=True)
    assert got.dtype == "float32" and "0.96x" in got.why


def test_with_the_mode_off_each_dtype_takes_its_fastest_kernels():
    # An AMX machine (unseen here): oneDNN's bfloat16 far ahead at prefill.
    amx = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.010, 0.003),
                  onednn_float32=(0.012, 0.005), onednn_bfloat16=(0.002, 0.003))  # fmt: skip
    off = choose(amx, invariant=False)
    assert off.dtype == "bfloat16" and "onednn bfloat16" in off.why and off.prefill == "kvharbor"
    on = choose(amx, invariant=True)  # invariant engines run kvharbor's kernels whatever is faster
    assert "onednn" not in on.why and on.dtype == "bfloat16"
    faster = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.010, 0.004),
                     onednn_float32=(0.009, 0.004), onednn_bfloat16=(0.010, 0.004))  # fmt: skip
    assert choose(faster, invariant=False).prefill == "onednn"  # 10% faster
    # The mode off never runs bfloat16 on the packed GEMM: without oneDNN it stays float32.
    no_onednn = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.005, 0.002))
    assert choose(no_onednn, invariant=False).dtype == "float32"
    assert choose(no_onednn, invariant=True).dtype == "bfloat16"
    tie = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.010, 0.004),
                  onednn_float32=(0.0098, 0.004), onednn_bfloat16=(0.010, 0.004))  # fmt: skip
    assert choose(tie, invariant=False).prefill == "kvharbor"  # 2%: noise, keep one path


def test_a_measured_dtype_decides_auto_but_not_an_asked_one_nor_quantized_weights():
    plain = CpuInfo("x86_64", "AMD EPYC", frozenset({"avx2", "fma"}), 2)  # the rule says float32 here
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, plain) == torch.float32
    assert resolve_dtype("auto", cpu, plain, measured="bfloat16") == torch.bfloat16
    assert resolve_dtype("float32", cpu, plain, measured="bfloat16") == torch.float32
    assert resolve_dtype("auto", cpu, plain, quantized=True, measured="bfloat16") == torch.float32


@needs_kernels
def test_the_probe_times_every_candidate_here_and_says_why(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("KVHARBOR_CACHE_DIR", str(tmp_path))  # nothing kept from before: measured here
    kernel_probe.probed.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="kvharbor.engine.cpu.kernel_probe"):
            choice = kernel_probe.probed(2, False)
    finally:
        kernel_probe.probed.cache_clear()
    assert choice.dtype in ("float32", "bfloat16") and choice.prefill in ("kvharbor", "onednn")
    line = caplog.records[-1].getMessage()
    assert line.startswith(f"dtype auto: {choice.dtype}") and "kvharbor float32: prefill" in line
    assert "GFLOP/s" in line and "decode turn" in line


@needs_kernels
def test_an_engine_on_auto_runs_the_measured_dtype(tiny_llama, make_llm, monkeypatch):
    picked = kernel_probe.Choice("bfloat16", "kvharbor", "faked")
    monkeypatch.setattr(kernel_probe, "probed", lambda threads, invariant: picked)
    llm = make_llm(tiny_llama.loaded, dtype="auto")
    assert llm.engine.core.model.embed.dtype == torch.bfloat16
    picked = kernel_probe.Choice("float32", "kvharbor", "faked")
    assert make_llm(tiny_llama.loaded, dtype="auto").engine.core.model.embed.dtype == torch.float32


@needs_kernels
def test_the_figures_are_kept_for_the_machines_later_engines(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv("KVHARBOR_CACHE_DIR", str(tmp_path))
    faked = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.010, 0.002))
    calls = []
    monkeypatch.setattr(kernel_probe, "measure", lambda kernels, onednn: calls.append(onednn) or faked)

    def start() -> kernel_probe.Choice:  # a new engine process: probed is cached per process
        kernel_probe.probed.cache_clear()
        try:
            with caplog.at_level(logging.INFO, logger="kvharbor.engine.cpu.kernel_probe"):
                return kernel_probe.probed(2, True)
        finally:
            kernel_probe.probed.cache_clear()

    first = start()
    kept = kernel_probe.cache_path(cpu_kernels.load(2), 2, True)
    assert calls == [False] and first.dtype == "bfloat16" and kept.is_file()
    assert f"measured now, kept at {kept}" in caplog.records[-1].getMessage()
    assert start() == first and calls == [False]  # read, not measured again
    assert f"measured at {kept}" in caplog.records[-1].getMessage()
    assert kernel_probe.cache_path(cpu_kernels.load(2), 2, False) != kept  # the other mode: its own figures

    for torn in ("{", '{"prefill": {"kvharbor float32": 0.01}, "decode": {}}',
                 '{"prefill": {"kvharbor float32": -1}, "decode": {"kvharbor float32": 1}}'):  # fmt: skip
        kept.write_text(torn)
        assert start() == first and len(calls) == 2  # measured again, and kept again whole
        assert "cannot be read" in caplog.text and kernel_probe._read(kept) == faked
        calls.pop()
        caplog.clear()


@needs_kernels
def test_a_cache_that_cannot_be_written_still_starts_the_engine(caplog, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache's folder would go
    monkeypatch.setenv("KVHARBOR_CACHE_DIR", str(blocked))
    faked = figures(kvharbor_float32=(0.010, 0.004), kvharbor_bfloat16=(0.010, 0.0039))
    monkeypatch.setattr(kernel_probe, "measure", lambda kernels, onednn: faked)
    kernel_probe.probed.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="kvharbor.engine.cpu.kernel_probe"):
            assert kernel_probe.probed(2, True).dtype == "float32"
    finally:
        kernel_probe.probed.cache_clear()
    assert "could not keep the kernel probe's figures" in caplog.text
    assert caplog.records[-1].getMessage().endswith("measured now: " + faked.line())
