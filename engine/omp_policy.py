"""OpenMP's wait policy for torch's threads, set before torch loads (engine/__init__.py imports
this first).

NOTE: OpenMP threads that spin while idle collapse CPU decode ~10x on a busy 2-core machine
(measured: 1.6 tok/s instead of ~14 at torch's default two threads), but threads that sleep at
once pay a futex wake-up per parallel region: ~0.4 ms for an RMSNorm of 64 rows, ~15% of a decode
step. A short spin (GOMP_SPINCOUNT) before sleeping keeps both costs small. It was 20,000 (~1 ms
at most); measured on the 2-core family-26 EPYC (2026-12-07), a gguf 128-token prefill (torch's
norms, SiLU and SDPA between the kernels' products, with the mode off) took 145-157 ms at 20,000
against 99-105 at 2,000 (133 at 300, 169 at 0): an OpenMP thread still spinning after a torch op
held a core the next kernel call needed both of. Float32 prefill with the mode off: 93-105 ms
against 123-143; batch-invariant engines, which run few torch ops, within the noise. Both
are read once, when torch loads OpenMP: a process that imported torch first keeps spinning threads,
which fight the kernels' own (a float32 decode step of 8 measured 30 ms against 16 on a 2-core
EPYC), and engine/model/device.py warns.
"""

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")

# False when torch loaded first and the user set no policy.
POLICY_SET = "OMP_WAIT_POLICY" in os.environ
