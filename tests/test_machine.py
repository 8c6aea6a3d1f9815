"""The CPU record and `dtype=auto` on faked machines: the choice must follow the CPU's flags, not
the machine the suite happens to run on."""

from __future__ import annotations

import pytest
import torch

from kvharbor.common.machine import ISA_FLAGS, cpu_info, machine_record, machine_title, parse_cpuinfo
from kvharbor.engine.model.device import resolve_dtype

X86_BASE = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2"
CPUINFO = {
    # Sapphire Rapids: AMX and AVX512-BF16
    "amx": ("x86_64", "Intel(R) Xeon(R) Platinum 8480+",
            f"{X86_BASE} avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"),
    # Cooper Lake: AVX512-BF16 without AMX, as AMD's Zen 4
    "avx512_bf16": ("x86_64", "Intel(R) Xeon(R) Platinum 8380H", f"{X86_BASE} avx512f avx512bw avx512_bf16"),
    # Zen 4 (the EPYC these tests met on 2026-12-04 and 06): AVX512-BF16 and VNNI, no AMX
    "zen4": ("x86_64", "AMD EPYC", f"{X86_BASE} avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"),
    # Skylake-SP: AVX-512 without BF16 emulates bfloat16
    "avx512_no_bf16": ("x86_64", "Intel(R) Xeon(R) Gold 6148", f"{X86_BASE} avx512f avx512bw avx512vl"),
    # Zen 1/2: AVX2 and FMA only
    "avx2": ("x86_64", "AMD EPYC 7551 32-Core Processor", X86_BASE),
    # Neoverse V1 (Graviton3) has the BF16 extension, unmeasured here
    "aarch64": ("aarch64", None, "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm sve"),
}  # fmt: skip
# kind -> what auto runs for plain weights, and for quantized ones (their kernels take float32 rows:
# common/machine.py has the figures; AMX keeps bfloat16 until issue 22 measures it)
EXPECTED = {
    "amx": (torch.bfloat16, torch.bfloat16),
    "avx512_bf16": (torch.bfloat16, torch.float32),
    "zen4": (torch.bfloat16, torch.float32),
    "avx512_no_bf16": (torch.float32, torch.float32),
    "avx2": (torch.float32, torch.float32),
    "aarch64": (torch.float32, torch.float32),
}


def fake_cpuinfo(kind: str) -> str:
    arch, model, flags = CPUINFO[kind]
    if arch == "aarch64":
        cpu = f"BogoMIPS\t: 2100.00\nFeatures\t: {flags}\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    else:
        cpu = f"vendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n"
    return "\n".join(f"processor\t: {i}\n{cpu}" for i in range(2))


@pytest.mark.parametrize("kind", sorted(CPUINFO))
def test_auto_dtype_follows_the_cpu_flags(kind):
    cpu = parse_cpuinfo(fake_cpuinfo(kind), CPUINFO[kind][0], cores=2)
    plain, quantized = EXPECTED[kind]
    assert resolve_dtype("auto", torch.device("cpu"), cpu) == plain
    assert resolve_dtype("auto", torch.device("cpu"), cpu, quantized=True) == quantized
    # an explicit dtype is never second-guessed
    for q in (False, True):
        assert resolve_dtype("float32", torch.device("cpu"), cpu, quantized=q) == torch.float32
        assert resolve_dtype("bfloat16", torch.device("cpu"), cpu, quantized=q) == torch.bfloat16


def test_auto_is_bfloat16_on_cuda_whatever_the_host_cpu():
    cpu = parse_cpuinfo(fake_cpuinfo("avx2"), "x86_64", cores=2)
    assert resolve_dtype("auto", torch.device("cuda"), cpu) == torch.bfloat16


def test_the_record_names_model_flags_and_cores():
    cpu = parse_cpuinfo(fake_cpuinfo("amx"), "x86_64", cores=2)
    record = cpu.describe()
    assert record["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+" and record["cores"] == 2
    assert record["isa"]["amx_bf16"] and record["isa"]["avx512_bf16"] and record["isa"]["avx2"]
    assert set(record["isa"]) == set(ISA_FLAGS)
    assert "amx_bf16" in cpu.short() and "2 cores" in cpu.short()
    arm = parse_cpuinfo(fake_cpuinfo("aarch64"), "aarch64", cores=4)
    assert arm.model.startswith("aarch64") and "0xd40" in arm.model and arm.isa()["bf16"]
    assert not arm.isa()["avx2"]


def test_this_machines_record_carries_the_dtype():
    record = machine_record("float32")
    assert record["dtype"] == "float32" and record["cores"] == cpu_info().cores >= 1
    assert record["cpu_model"] and set(record["isa"]) == set(ISA_FLAGS)
    assert machine_title("float32").endswith(", float32")


def test_cpu_lists_parse_and_bad_ones_say_how_to_write_them():
    from kvharbor.common.machine import parse_cpu_list, pin_to_cpus

    assert parse_cpu_list("0") == {0} and parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    for bad in ("", "a", "3-1", "0-", "1,,2"):
        with pytest.raises(ValueError, match="write CPUs as"):
            parse_cpu_list(bad)
    assert pin_to_cpus(None) is None
    with pytest.raises(ValueError, match="may only run on CPUs"):
        pin_to_cpus("4095")


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_the_engine_resolves_auto_for_its_own_weights(monkeypatch, tiny_llama, quantization):
    """On a Zen 4, the rule's auto is bfloat16 for plain weights and float32 for quantized ones: the
    engine must tell the rule which it holds."""
    from kvharbor.common import machine
    from kvharbor.engine import LLM
    from kvharbor.engine.cpu import kernel_probe

    zen4 = parse_cpuinfo(fake_cpuinfo("zen4"), "x86_64", cores=2)
    monkeypatch.setattr(machine, "cpu_info", lambda: zen4)
    # The rule is the fallback where the start-up probe does not run (engine/cpu/kernel_probe.py);
    # the probe's own choice is timed, so it is faked away here and tested in test_kernel_probe.py.
    monkeypatch.setattr(kernel_probe, "probed", lambda threads, invariant: None)
    llm = LLM(loaded_model=tiny_llama.loaded, quantization=quantization, num_kv_blocks=16)
    assert llm.engine.core.dtype == EXPECTED["zen4"][quantization != "none"]
