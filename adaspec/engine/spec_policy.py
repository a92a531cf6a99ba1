"""Verification-length policies: the swappable piece that picks l_r for each drafted request.

- FixedPolicy: verify every reserved draft slot (l_r = k, or fewer near max_tokens).
- AdaptivePolicy: confidence-scheduled budget (spec/policy.py). Lossless design: the budget
  B* comes from the PREVIOUS step's confidences, the top-B* allocation from the current
  survivals, which for slot j involve only drafts before j (see spec/policy.py's docstring).
"""
from __future__ import annotations

import numpy as np

from adaspec.spec.policy import AdaptiveBudget


class FixedPolicy:
    def plan(self, request_ids, conf, n_sampling, base_tokens, limits):
        return np.asarray(limits, dtype=np.int64)

    def observe(self, request_ids, conf) -> None:
        pass

    def forget(self, request_id) -> None:
        pass


class AdaptivePolicy:
    def __init__(self, cost_model, k: int, ema_alpha: float | None = None, leaky: bool = False):
        self.budget = AdaptiveBudget(cost_model, k, ema_alpha=ema_alpha, leaky=leaky)

    def plan(self, request_ids, conf, n_sampling, base_tokens, limits):
        return self.budget.plan(request_ids, conf, n_sampling, base_tokens, limits=limits).astype(np.int64)

    def observe(self, request_ids, conf) -> None:
        self.budget.observe(request_ids, conf)

    def forget(self, request_id) -> None:
        self.budget.forget(request_id)
