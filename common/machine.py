"""What CPU this process runs on: model, ISA flags and cores, read from /proc/cpuinfo (no torch).

The engine's `dtype=auto` decides on it, and every benchmark records it, because the machines
this project runs on differ: an Intel Xeon with AMX and an AMD EPYC Zen 4 (AVX512-BF16) run
bfloat16, while an AMD EPYC with AVX2 only has no fast bfloat16 at all and runs float32.
Figures from different kinds must never be compared by mistake.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

# The flags that decide speed here; benchmarks report each as present or not.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "asimd", "bf16")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    arch: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]
    cores: int  # CPUs this process may run on

    def fast_bf16(self, quantized: bool = False) -> bool:
        """Whether the engine runs bfloat16 faster than float32 here: on x86 with AMX, and with
        AVX512-BF16 for weights that are not quantized. The fallback rule: where kvharbor's
        kernels run, `--dtype auto` with float weights follows what engine/cpu/kernel_probe.py
        measures at start-up instead (benchmarks that name `auto`'s dtype still read this rule).
        NOTE: measured 2026-12-06 on a 2-core AMD EPYC Zen 4 (avx512_bf16, no AMX), SmolLM2, with
        the kernels of that day (benchmarks/dtype_auto.py, results/dtype_auto.json): bfloat16
        decoded 2.07x / 1.32x float32's output tok/s at 1 / 8 sequences (72.3 / 254.7 against
        34.9 / 193.1: the C kernel widens bfloat16 weights exactly, and a step reads half the
        bytes), its cold prefill took the same time (213 against 207 ms for 128 tokens, 1.14 s
        for 512 in both), and the quality ledger put it at KL 0.0001 from float32. Quantized
        weights are the exception: their kernels take float32 rows, and bfloat16 ran gguf / int8
        at 0.28x / 0.30x float32 at 1 sequence and 0.52x / 0.50x at 8. AMX machines keep
        bfloat16 whatever the weights: the rule there is issue 22's, unmeasured with today's
        kernels. AVX-512 without BF16, and AVX2, emulate bfloat16. aarch64 is not assumed fast:
        no machine of this project has measured it, so `auto` keeps float32 there and a user who
        has measured passes --dtype bfloat16."""
        if self.arch not in ("x86_64", "AMD64", "i686"):
            return False
        return "amx_bf16" in self.flags or ("avx512_bf16" in self.flags and not quantized)

    def isa(self) -> dict[str, bool]:
        return {flag: flag in self.flags for flag in ISA_FLAGS}

    def describe(self) -> dict:
        """The machine record every benchmark JSON carries."""
        return {"cpu_model": self.model, "arch": self.arch, "cores": self.cores, "isa": self.isa()}

    def short(self) -> str:
        """One line for plot titles: model, cores and the fast-path flags present."""
        present = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "bf16") if f in self.flags]
        return f"{self.model}, {self.cores} cores, {'/'.join(present) or 'no AVX2'}"


def parse_cpuinfo(text: str, arch: str, cores: int) -> CpuInfo:
    """A CpuInfo from the text of /proc/cpuinfo (x86 says `flags` and `model name`; aarch64 says
    `Features` and names no model)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    flags = frozenset((fields.get("flags") or fields.get("Features") or "").split())
    model = fields.get("model name")
    if not model:
        part = fields.get("CPU part")
        model = f"{arch} (implementer {fields.get('CPU implementer', '?')}, part {part})" if part else arch
    return CpuInfo(model=model, arch=arch, flags=flags, cores=cores)


def cpu_info() -> CpuInfo:
    """This machine's CpuInfo."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine(), len(os.sched_getaffinity(0)))


def auto_cpu_dtype(cpu: CpuInfo | None = None, quantized: bool = False) -> str:
    """What the engine's dtype=auto runs on this CPU (or `cpu`), for quantized weights or not:
    bfloat16 where it is fast, else float32."""
    return "bfloat16" if (cpu or cpu_info()).fast_bf16(quantized) else "float32"


def machine_record(dtype: str | None = None) -> dict:
    """What a benchmark JSON records about where it ran: the CPU, its flags, cores and the dtype."""
    record = cpu_info().describe()
    if dtype is not None:
        record["dtype"] = dtype
    return record


def machine_title(dtype: str | None = None) -> str:
    """The same, for a plot title."""
    line = cpu_info().short()
    return f"{line}, {dtype}" if dtype else line


def parse_cpu_list(text: str) -> set[int]:
    """CPUs as Linux writes them ("0", "0-3,8"); ValueError with what is wrong."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"cpu_affinity {text!r}: write CPUs as 0 or 0-3,8")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin_to_cpus(text: str | None) -> set[int] | None:
    """Run this process (and the children it starts from now on) on these CPUs only; None: as is.
    Why: engines sharing a machine's few cores (P/D measured on 2 cores) must not steal each
    other's; a pinned engine also sizes its torch threads to the CPUs it got (engine/model/device.py)."""
    if not text:
        return None
    cpus = parse_cpu_list(text)
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"cpu_affinity {text!r}: this process may only run on CPUs {sorted(allowed)}")
    os.sched_setaffinity(0, cpus)
    return cpus
