"""OpenMP's wait policy for torch's threads, set before torch loads (engine/__init__.py imports
this first).

NOTE: OpenMP threads that spin while idle collapse CPU decode ~10x on a busy 2-core machine
(measured: 1.6 tok/s instead of ~14 at torch's default two threads), but threads that sleep at
once pay a futex wake-up per parallel region: ~0.4 ms for an RMSNorm of 64 rows, ~15% of a decode
step. A short spin (GOMP_SPINCOUNT, ~1 ms at most) before sleeping keeps both costs small. Both
are read once, when torch loads OpenMP: a process that imported torch first keeps spinning threads,
which fight the kernels' own (a float32 decode step of 8 measured 30 ms against 16 on a 2-core
EPYC), and engine/model/device.py warns.
"""

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

# False when torch loaded first and the user set no policy.
POLICY_SET = "OMP_WAIT_POLICY" in os.environ
