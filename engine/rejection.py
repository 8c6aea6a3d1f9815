"""Exact acceptance of speculated tokens (Leviathan et al. 2023; the seeds' speculative-sampling
notes): the tokens that come out are distributed exactly as if the target had sampled them one
by one, whatever the proposer proposed.

At draft position j, with target distribution p_j and draft distribution q_j (after every
sampling option was applied to both):
- accept the draft token x with probability min(1, p_j(x) / q_j(x));
- on the first rejection, draw from max(0, p_j - q_j), renormalized, and stop;
- if all k were accepted, draw one more token from p_k.
A deterministic proposer (n-gram lookup) is q_j = delta_x: accept with probability p_j(x), else
draw from p_j with x removed. Greedy requests accept exactly when x is p_j's argmax.
"""

from __future__ import annotations

import torch


def accept_greedy(argmaxes: list[int], draft: list[int]) -> list[int]:
    """Tokens out: the accepted prefix of `draft`, then the target's own token (argmaxes has k + 1)."""
    out = []
    for j, x in enumerate(draft):
        if x != argmaxes[j]:
            return [*out, argmaxes[j]]
        out.append(x)
    return [*out, argmaxes[len(draft)]]


def accept_sampled(
    p: torch.Tensor,  # [k + 1, vocab] target probabilities
    draft: list[int],
    q: torch.Tensor | None,  # [k, vocab] draft probabilities; None: deterministic proposer
    generator: torch.Generator,
) -> list[int]:
    """Tokens out, 1 to k + 1 of them, distributed as sampling from p one position at a time."""
    out = []
    for j, x in enumerate(draft):
        px = float(p[j, x])
        qx = 1.0 if q is None else float(q[j, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0.0 and u < px / qx:
            out.append(x)
            continue
        residual = p[j].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[j]).clamp_(min=0.0)
        total = float(residual.sum())
        # p == q (or p is all on x): rejection had probability 0, so this is only float dust.
        dist = residual / total if total > 0.0 else p[j]
        return [*out, int(torch.multinomial(dist, 1, generator=generator))]
    return [*out, int(torch.multinomial(p[len(draft)], 1, generator=generator))]
