"""Online calibration of the confidences on the served traffic: per draft position, how many of
the verified drafts the target accepted against how many their predicted survival promised.

The drafter's confidences are calibrated (STS) on held-out blocks, but served prompts can accept
less: on the H200 at T = 1 the code-0.6b pair's drafts were accepted 0.80-0.87x as often as the
held-out blocks promised at positions 2-7 (BENCHMARKS.md, run 24), and the adaptive budget, priced
on the promise, verified nearly all 7 drafts at 64 requests where 3 made 4% more. With
`adaptive_verification_online_calibration` the budget's survivals are scaled, position by
position, by the ratio realized / predicted over the recent verified drafts, so B* follows what
the target really accepts.

Lossless: the ratios come from steps already verified, never from a current draft. Unbiased for
what it corrects: survival s_j predicts the chance that draft j is accepted, and a verified draft's
acceptance is observed whatever came before it (a rejected earlier draft makes it count as not
accepted, as s_j does).
"""
from __future__ import annotations

import numpy as np


class SurvivalCorrection:
    def __init__(self, k: int, decay: float = 0.995, min_predicted: float = 32.0, floor: float = 0.25):
        # decay: weight kept by the past per observed step (~200 steps of memory: the text and the
        # batch drift); min_predicted: a position's ratio is used once its decayed predicted sum
        # reaches this many drafts; floor: the smallest factor (a position whose drafts are never
        # accepted still keeps some weight, so probes can see it recover)
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.k, self.decay, self.min_predicted, self.floor = int(k), decay, min_predicted, floor
        self.accepted = np.zeros(self.k)
        self.predicted = np.zeros(self.k)

    def update(self, verify_lens, accepted, survivals) -> None:
        """One step's drafted requests: verify_lens [R] drafts verified, accepted [R] of them
        accepted (a prefix), survivals [R, >= k] what was predicted for each slot."""
        verify_lens = np.asarray(verify_lens, dtype=np.int64)
        if len(verify_lens) == 0:
            return
        pos = np.arange(self.k)[None, :]
        verified = verify_lens[:, None] > pos
        acc = np.minimum(np.asarray(accepted, dtype=np.int64), verify_lens)[:, None] > pos
        surv = np.nan_to_num(np.asarray(survivals, dtype=np.float64)[:, : self.k], nan=0.0)
        self.accepted = self.decay * self.accepted + acc.sum(axis=0)
        self.predicted = self.decay * self.predicted + np.where(verified, surv, 0.0).sum(axis=0)

    def factors(self) -> np.ndarray:
        """[k] realized / predicted where enough was seen, else 1; within [floor, 1 / floor]."""
        ratio = np.divide(self.accepted, self.predicted, out=np.ones(self.k), where=self.predicted > 0)
        ratio = np.where(self.predicted >= self.min_predicted, ratio, 1.0)
        return np.clip(ratio, self.floor, 1.0 / self.floor)

    def apply(self, survivals: np.ndarray) -> np.ndarray:
        """Survivals [R, K<=k] scaled by the factors, kept in [0, 1] and non-increasing along the
        block (a later draft cannot survive more often than an earlier one)."""
        s = np.asarray(survivals, dtype=np.float64)
        out = np.clip(s * self.factors()[None, : s.shape[1]], 0.0, 1.0)
        return np.minimum.accumulate(out, axis=1)
