"""TESTS ONLY: the adaptive budget computed from the CURRENT step's survivals (a global argmax
that looks at the drafts it is deciding about). Deliberately biased (VERIFY.md's two-token
example: target (0.7, 0.3) comes out as (0.85, 0.15)); it exists so the lossless tests can show
that their harness catches such a leak. Production code has no way to select it."""
import numpy as np

from adaspec.spec_decode.policy import AdaptiveBudget, allocate, choose_budget, survival


class LeakyBudget(AdaptiveBudget):
    def plan(self, request_ids, current_conf, n_sampling, base_tokens, num_requests=None, limits=None):
        a_now = survival(current_conf)
        nreq = len(request_ids) if num_requests is None else num_requests
        a_b = a_now if limits is None else np.where(np.arange(self.k)[None, :] < np.asarray(limits)[:, None], a_now, 0.0)
        self.last_budget = choose_budget(a_b, n_sampling, base_tokens, nreq, self.cost, self.max_budget)
        return allocate(a_now, self.last_budget, limits)
