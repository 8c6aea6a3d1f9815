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
MIN_CONTEXT_VARIANCE = 64.0  # nor contexts that moved by less than ~8 tokens (tokens^2)
MAX_CORRELATION2 = 0.99  # above this the two move together: the step is put on sequences alone


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
        seqs, ctx = vnn > MIN_SEQ_VARIANCE, vcc > MIN_CONTEXT_VARIANCE
        if seqs and ctx and vnc * vnc < MAX_CORRELATION2 * vnn * vcc:
            det = vnn * vcc - vnc * vnc
            per_seq, per_token = (vnt * vcc - vct * vnc) / det, (vct * vnn - vnt * vnc) / det
            if per_seq >= 0 and per_token >= 0:
                return per_seq, per_token
        if seqs:
            return max(0.0, vnt / vnn), 0.0
        if ctx:
            return 0.0, max(0.0, vct / vcc)
        return 0.0, 0.0
