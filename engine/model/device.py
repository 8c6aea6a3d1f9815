"""Where the engine runs and in what dtype: device, dtype (`auto` follows the CPU) and threads."""

from __future__ import annotations

import functools
import logging
import os

import torch

from kvharbor.common.machine import CpuInfo, auto_cpu_dtype
from kvharbor.engine import omp_policy

log = logging.getLogger("kvharbor.engine.model.device")


def physical_cores() -> int:
    """Cores this process may run on, counting hyper-threads of one core once: matmul threads
    sharing a core only fight over its vector units."""
    cpus = os.sched_getaffinity(0)
    siblings = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings.add(f.read().strip())
        except OSError:
            return len(cpus)
    return max(1, len(siblings))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def resolve_dtype(
    name: str, device: torch.device, cpu: CpuInfo | None = None, quantized: bool = False,
    measured: str | None = None,
) -> torch.dtype:  # fmt: skip
    """'auto' is bfloat16 on CUDA; on CPU, `measured` (what engine/cpu/kernel_probe.py timed for
    float weights), else the rule of CpuInfo.fast_bf16 (CPUs with AMX; with AVX512-BF16 unless the
    weights are `quantized`). `cpu` defaults to this machine."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    return getattr(torch, measured if measured is not None and not quantized else auto_cpu_dtype(cpu, quantized))


def cpu_threads(device: torch.device, threads: int | None) -> int:
    """Threads for CPU work: the configured count, else one per physical core."""
    return threads or physical_cores() if device.type == "cpu" else 1


def set_cpu_threads(device: torch.device, threads: int | None) -> None:
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(device, threads))
        if not omp_policy.POLICY_SET:
            _warn_spinning_threads()


@functools.cache  # once per process
def _warn_spinning_threads() -> None:
    log.warning(
        "torch was imported before kvharbor.engine, so OpenMP's idle threads spin and slow every "
        "step (about 2x on 2 cores): import kvharbor.engine first, or set OMP_WAIT_POLICY=PASSIVE "
        "GOMP_SPINCOUNT=2000 in the environment"
    )
