"""What a speculative step costs beyond its cost tables, and the tables with it added.

The cost tables (profiler.py) time the GPU work of a propose and of a verify forward. A real step
also pays the host (scheduling, bookkeeping, the read back) and, under load, the prefill chunks
that ride along; on the H200 at 256 requests that was ~7 of a ~14 ms speculative step (BENCHMARKS.md,
run 8). A cost that every candidate step pays alike changes which budget is best: the objective
(n + sum of the B best survivals) / (overhead + draft_ms + verify_ms(T + B)) favours a larger B as
the overhead grows (for B2 > B1, B2 wins iff overhead * (gain2 - gain1) > gain1 * cost2 - gain2 * cost1,
and the left side grows with the overhead). Without it the policy verifies fewer drafts than pays.

`StepOverhead` holds the overhead: a fixed value, or "measured": an exponential average of
(the step's wall time - the tables' time for what it ran), updated after each step the policy
planned, priced at 0 while the average is negative. The samples themselves are not floored: the
pipelined step is timed launch to launch, so a step launched behind a long one (a prompt-chunk
step) carries that step's GPU time while the long one's own interval is short, and the samples
alternate around the true overhead. Flooring each sample kept the long ones and dropped the short
ones' negative residual: on the Qwen3-8B shape (H100 run 74) that estimate ran up to 10.7 ms; in run
75 it read 5.4-5.6 ms where the floored average, over the same samples, read 2.1-2.3 ms. Only past
steps' times enter, so no decision depends on a current draft (lossless, policy.py).
`OverheadCost` adds it to every verify forward's price, so drafting and a plain step are both
charged it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from adaspec.spec_decode.cost_model import WrappedCost

MEASURED = "measured"


class StepOverhead:
    def __init__(self, setting: float | str = 0.0, alpha: float = 0.1):
        if setting == MEASURED:
            self.measured, self.value = True, 0.0
        elif isinstance(setting, (int, float)) and not isinstance(setting, bool) and setting >= 0:
            self.measured, self.value = False, float(setting)
        else:
            raise ValueError(f"step overhead must be a number of ms >= 0 or {MEASURED!r}, got {setting!r}")
        self.alpha = alpha
        self.samples = 0
        self.signed = 0.0  # the average before the floor
        # for the benchmarks, never priced: how many samples were negative (the step ran faster
        # than its price), and the estimate that floored each sample (the rule before run 74's
        # finding), to show the bias where long and short steps alternate
        self.floored = 0
        self.per_sample_floored = 0.0

    def observe(self, wall_ms: float, predicted_ms: float) -> None:
        """One planned step: it took wall_ms, the tables priced what it ran at predicted_ms."""
        if not self.measured:
            return
        raw = float(wall_ms) - float(predicted_ms)
        first = self.samples == 0
        self.signed = raw if first else self.alpha * raw + (1.0 - self.alpha) * self.signed
        self.value = max(0.0, self.signed)
        floored = max(0.0, raw)
        self.per_sample_floored = (floored if first else
                                   self.alpha * floored + (1.0 - self.alpha) * self.per_sample_floored)
        self.floored += raw < 0
        self.samples += 1

    def snapshot(self) -> dict:
        """The state a benchmark records: the value priced, the signed average, the samples, how
        many of them were negative, and the per-sample-floored average (not priced)."""
        return {"ms": round(self.value, 3), "signed_ms": round(self.signed, 3), "samples": self.samples,
                "floored": self.floored, "per_sample_floored_ms": round(self.per_sample_floored, 3)}


class OverheadCost(WrappedCost):
    """A cost model (plain, or graphed_step.GraphPaddedCost) with the step overhead added to every
    verify forward's price; draft_ms unchanged."""

    def __init__(self, cost: Any, overhead: StepOverhead):
        super().__init__(cost)
        self.overhead = overhead

    def verify_ms(self, n_tokens):
        return np.asarray(self.cost.verify_ms(n_tokens), dtype=np.float64) + self.overhead.value

    def verify_ms_for(self, num_requests: int, tokens) -> np.ndarray:
        from adaspec.spec_decode.policy import step_verify_ms

        return np.asarray(step_verify_ms(self.cost, num_requests, tokens), dtype=np.float64) + self.overhead.value
