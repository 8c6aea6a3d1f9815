"""How a decode step's time grows: a decayed least-squares line of step seconds over the sequences
the step ran and the context tokens they attend over (the KV it reads), from the last ~50 decode
steps. The gateway extrapolates both slopes to predict the inter-token latency a new request
would see (common/load_report.py decode_step_s_at).

Why two regressors: a step's weight reads grow with its rows, its attention with the KV the rows
read. An engine decoding a few long contexts is slower than its sequence count says, and the
per-sequence line alone cannot tell it from one decoding many short ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.98  # per step: the fit forgets a step's weight by half in ~35 steps
MIN_SEQ_VARIANCE = 0.01  # batch sizes that never moved give no per-sequence slope
# Nor contexts whose spread is under 10% of their mean: a fixed batch's context creeps up by a few
# tokens a step, and a slope fitted over that creep would be extrapolated to prompts far longer.
MIN_CONTEXT_SPREAD = 0.1
MAX_CORRELATION2 = 0.81  # |r| above 0.9: the two move together and their split is noise


@dataclass
class DecodeFit:
    # decayed sums of 1, n, c, t, n^2, n c, c^2, n t, c t (n sequences, c context tokens, t seconds)
    _sums: list[float] = field(default_factory=lambda: [0.0] * 9)

    def add(self, sequences: int, context_tokens: int, seconds: float) -> None:
        n, c, t = float(sequences), float(context_tokens), seconds
        sample = (1.0, n, c, t, n * n, n * c, c * c, n * t, c * t)
        self._sums = [DECAY * acc + x for acc, x in zip(self._sums, sample, strict=True)]

    def slopes(self) -> tuple[float, float]:
        """(seconds per sequence, seconds per context token), each >= 0 (a falling slope is noise
        here); a regressor that has not varied gets 0 and leaves the step to the other."""
        w, n, c, t, nn, nc, cc, nt, ct = self._sums
        if w <= 0:
            return 0.0, 0.0
        vnn, vcc, vnc = (nn - n * n / w) / w, (cc - c * c / w) / w, (nc - n * c / w) / w
        vnt, vct = (nt - n * t / w) / w, (ct - c * t / w) / w
        seqs, ctx = vnn > MIN_SEQ_VARIANCE, vcc > (MIN_CONTEXT_SPREAD * c / w) ** 2
        if seqs and ctx and vnc * vnc < MAX_CORRELATION2 * vnn * vcc:
            det = vnn * vcc - vnc * vnc
            per_seq, per_token = (vnt * vcc - vct * vnc) / det, (vct * vnn - vnt * vnc) / det
            if per_seq >= 0 and per_token >= 0:
                return per_seq, per_token
        # One line only: the regressor that alone explains more of the step's variance.
        by_seq = (max(0.0, vnt / vnn), 0.0) if seqs else (0.0, 0.0)
        by_ctx = (0.0, max(0.0, vct / vcc)) if ctx else (0.0, 0.0)
        explained_seq = vnt * vnt / vnn if seqs and vnt > 0 else 0.0
        explained_ctx = vct * vct / vcc if ctx and vct > 0 else 0.0
        return by_ctx if explained_ctx > 1.05 * explained_seq else by_seq  # a tie stays on sequences
