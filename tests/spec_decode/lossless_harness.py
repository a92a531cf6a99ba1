"""Reusable chi-square harness: do sampled token sequences follow an exact joint distribution?

Used by the sampler-level tests here and by the engine-level losslessness tests:

    exact = enumerate_joint(next_probs, L)            # {(t1,..,tL): prob}
    p = lossless_pvalue(lambda n: generate(n), exact, n=20000)
    assert p > 1e-3                                    # and a broken sampler gives p < 1e-6

Cells whose expected count is below ``min_expected`` are pooled (smallest first) into one
"rare" cell, so the chi-square approximation holds. A sample with exact probability 0 is an
impossible outcome: the p-value is 0.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Sequence

import numpy as np
from scipy.stats import chisquare


def enumerate_joint(next_probs: Callable[[tuple], Sequence[float]], length: int, prefix: tuple = ()) -> dict:
    """Exact joint law of the next ``length`` tokens: next_probs(context) -> probability vector
    of the next token given the context tuple (prefix + tokens generated so far)."""
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, pr in out.items():
            for tok, pt in enumerate(next_probs(prefix + seq)):
                if pt > 0:
                    nxt[seq + (tok,)] = pr * float(pt)
        out = nxt
    return out


def chi_square_pvalue(samples, exact: Mapping[tuple, float], min_expected: float = 5.0) -> float:
    """p-value of the samples [N, L] (array or sequences; extra columns ignored) against
    ``exact`` ({tuple of L tokens: probability}, summing to 1)."""
    L = len(next(iter(exact)))
    total = float(sum(exact.values()))
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"exact distribution sums to {total}, not 1")
    rows = [tuple(int(t) for t in s[:L]) for s in np.asarray(samples)]
    n = len(rows)
    obs = Counter(rows)
    if any(exact.get(k, 0.0) <= 0.0 for k in obs):
        return 0.0  # an outcome the target can never produce
    keys = sorted(exact, key=lambda k: exact[k])  # ascending expected count
    exp = np.array([exact[k] * n / total for k in keys])
    cnt = np.array([obs.get(k, 0) for k in keys], dtype=np.float64)
    # pool the smallest cells until the pool itself is large enough
    cut = int(np.searchsorted(np.cumsum(exp), min_expected, side="left")) + 1 if exp[0] < min_expected else 0
    cut = max(cut, int(np.searchsorted(exp, min_expected, side="left")))
    if cut > 0:
        exp = np.r_[exp[:cut].sum(), exp[cut:]]
        cnt = np.r_[cnt[:cut].sum(), cnt[cut:]]
    if exp.size < 2:
        raise ValueError("too few samples for a chi-square test (fewer than 2 cells)")
    return float(chisquare(cnt, exp).pvalue)


def lossless_pvalue(sample_fn: Callable[[int], object], exact: Mapping[tuple, float], n: int = 20000,
                    min_expected: float = 5.0) -> float:
    """sample_fn(n) returns n sampled sequences (each at least L tokens); returns the p-value."""
    samples = sample_fn(n)
    if len(samples) != n:
        raise ValueError(f"sample_fn returned {len(samples)} sequences, expected {n}")
    return chi_square_pvalue(samples, exact, min_expected)


def marginal(exact: Mapping[tuple, float], length: int) -> dict:
    """Joint law of the first ``length`` tokens of ``exact``."""
    out: dict = {}
    for k, v in exact.items():
        out[k[:length]] = out.get(k[:length], 0.0) + v
    return out
