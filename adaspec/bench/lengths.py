"""Output lengths that vary from request to request (`--random-range-ratio`, vLLM's flag name).

With every request asking for the same number of tokens (ignore_eos), a closed loop without
speculation runs in waves: a batch of requests starts together, ends on the same step, and the
next batch's prompts are prefilled in a few steps with no decoding rows beside them. Speculation
ends requests on different steps, so its prompts arrive one by one and its steps mix prefill with
decoding (H200 run 18, BENCHMARKS.md). Lengths spread over [L(1 - r), L(1 + r)] take that artefact
away from the comparison. vLLM samples its random dataset's input and output lengths with the
ratio; here it spreads the output lengths of every dataset's requests.
"""
from __future__ import annotations

import math

import numpy as np


def check_range_ratio(ratio: float) -> float:
    """The ratio, or a ValueError naming the accepted range (vLLM's: 0 <= r < 1)."""
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 0 <= ratio < 1):
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio!r}")
    return float(ratio)


def output_lengths(num: int, output_len: int, range_ratio: float, seed: int) -> list[int]:
    """num lengths drawn uniformly from the integers in [floor(L(1 - r)), ceil(L(1 + r))] (at least
    1), from a generator seeded with `seed`: every arm of a sweep gets the same lengths for the same
    seed. r = 0: every request asks for L."""
    r = check_range_ratio(range_ratio)
    if r == 0:
        return [output_len] * num
    low = max(1, math.floor(output_len * (1 - r)))
    high = max(low, math.ceil(output_len * (1 + r)))
    return np.random.default_rng(seed).integers(low, high + 1, size=num).tolist()
