"""Verification-length policies: the swappable piece that picks l_r for each drafted request.

- FixedPolicy: verify every reserved draft slot (l_r = k, or fewer near max_tokens).
- AdaptivePolicy: confidence-scheduled budget (spec/policy.py). Lossless design: the budget
  B* comes from the PREVIOUS step's confidences, the top-B* allocation from the current
  survivals, which for slot j involve only drafts before j (see spec/policy.py's docstring).
"""
from __future__ import annotations

import numpy as np

from adaspec.spec.policy import AdaptiveBudget, allocate, budget_objective, survival


class FixedPolicy:
    def should_draft(self, request_ids, n_sampling, base_tokens, limits) -> bool:
        return True

    def plan(self, request_ids, conf, n_sampling, base_tokens, limits):
        return np.asarray(limits, dtype=np.int64)

    def observe(self, request_ids, conf) -> None:
        pass

    def forget(self, request_id) -> None:
        pass


class AdaptivePolicy:
    """Besides the budget, decides whether drafting pays at all this step (beyond vLLM, whose
    budget can only drop to B = 0 after the drafts were paid for): the best expected rate with
    drafting, (n_sampling + sum of the B best OLD survivals) / (draft_ms(R) + verify_ms(T + B)),
    against a plain step's n_sampling / verify_ms(T). Old confidences only, so the choice never
    depends on a current draft (lossless). Every `probe_every`-th skipped step drafts anyway, to
    refresh confidences that would otherwise stay as old as the last drafted step."""

    def __init__(self, cost_model, k: int, ema_alpha: float | None = None, probe_every: int = 16):
        self.budget = AdaptiveBudget(cost_model, k, ema_alpha=ema_alpha)
        self.cost = cost_model
        self.probe_every = probe_every
        self.skipped_in_a_row = 0
        self._budget_now: int | None = None  # B* found by should_draft, reused by plan this step

    def should_draft(self, request_ids, n_sampling, base_tokens, limits) -> bool:
        self._budget_now = None
        if self.skipped_in_a_row + 1 >= self.probe_every:
            self.skipped_in_a_row = 0
            return True
        a = survival(self.budget.old_confidences(request_ids))
        a = np.where(np.arange(a.shape[1])[None, :] < np.asarray(limits)[:, None], a, 0.0)
        objective = budget_objective(a, n_sampling, base_tokens, len(request_ids), self.cost)
        # the same objective choose_budget maximizes (same old survivals, limits, step shape):
        # keep its argmax (first maximum = ties to the smaller B) so plan need not search again
        self._budget_now = int(np.argmax(objective))
        with_drafts = float(objective[self._budget_now])
        plain = n_sampling / max(float(self.cost.verify_ms(base_tokens)), 1e-12)
        if with_drafts > plain:
            self.skipped_in_a_row = 0
            return True
        self.skipped_in_a_row += 1
        return False

    def plan(self, request_ids, conf, n_sampling, base_tokens, limits):
        b, self._budget_now = self._budget_now, None
        if b is None:
            return self.budget.plan(request_ids, conf, n_sampling, base_tokens, limits=limits).astype(np.int64)
        self.budget.last_budget = b
        return allocate(survival(conf), b, limits).astype(np.int64)

    def observe(self, request_ids, conf) -> None:
        self.budget.observe(request_ids, conf)

    def forget(self, request_id) -> None:
        self.budget.forget(request_id)
