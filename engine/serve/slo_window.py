"""SLO attainment over recent requests: the share of requests finished in the last `window`
seconds whose TTFT and mean inter-token latency met the targets. /load reports it, and the
operator can scale on it (autoscaling metric `slo`). Mean ITL per request, as goodput is usually
counted (DistServe's TPOT), so one slow token in a long answer does not fail the whole request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence


class SLOWindow:
    def __init__(
        self, ttft_s: float, itl_s: float, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttft_s <= 0 or itl_s <= 0 or window_s <= 0:
            raise ValueError("SLO targets and the window must be > 0")
        self.ttft_s, self.itl_s, self.window_s = ttft_s, itl_s, window_s
        self._clock = clock
        self._done: deque[tuple[float, bool]] = deque()  # (finished at, met the SLO)

    def record(self, arrival: float, token_times: Sequence[float]) -> None:
        """One finished generation; one that produced no token counts as a miss."""
        met = bool(token_times) and token_times[0] - arrival <= self.ttft_s
        if met and len(token_times) > 1:
            met = (token_times[-1] - token_times[0]) / (len(token_times) - 1) <= self.itl_s
        self._done.append((self._clock(), met))
        self._prune()

    def _prune(self) -> None:
        horizon = self._clock() - self.window_s
        while self._done and self._done[0][0] < horizon:
            self._done.popleft()

    def attainment(self) -> tuple[float | None, int]:
        """(share that met the SLO, requests counted); None when none finished in the window."""
        self._prune()
        if not self._done:
            return None, 0
        return sum(met for _, met in self._done) / len(self._done), len(self._done)
