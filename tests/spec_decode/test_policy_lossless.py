"""The adaptive arm stays lossless (budget from one-step-old confidences); the leaky variant
(budget from the current drafts' confidences) is caught by the same chi-square harness."""
import numpy as np
import torch

from adaspec.spec_decode.cost_model import CostModel, CostTable
from adaspec.spec_decode.policy import AdaptiveBudget

from .leaky_budget import LeakyBudget
from .lossless_harness import chi_square_pvalue, marginal
from .micro import MicroSpec

N_SAMPLES = 20000


def grouped_policy(ab: AdaptiveBudget, n: int, group: int):
    """lengths_fn / step_hook pair: rows form batches of ``group`` requests sharing a budget."""
    def lengths_fn(step, conf):
        out = np.empty(n, dtype=np.int64)
        for g in range(0, n, group):
            ids = range(g, min(n, g + group))
            out[g:g + len(ids)] = ab.plan(list(ids), conf[g:g + len(ids)], len(ids), len(ids))
        return out

    def observe(step, conf):
        ab.observe(list(range(n)), conf)

    return lengths_fn, observe


def paper_example():
    """VERIFY.md's two-token example: target (0.7, 0.3), drafter (0.5, 0.5). The anchor (token 2,
    never generated) has confidence 0.5; after drafting 0 the next slot looks certain, after 1
    hopeless. Costs make B* = 2 when x_1 = 0 and B* = 0 when x_1 = 1 if B* sees current drafts."""
    P = [[0.7, 0.3, 0.0]] * 3
    Q = [[0.5, 0.5, 0.0]] * 3
    spec = MicroSpec(P, Q, C=[1.0, 0.01, 0.5], anchor=2, k=2)
    cost = CostModel(CostTable([1, 2, 3, 4, 8], [1.0, 1.6, 1.8, 2.6, 5.0]), CostTable([1], [0.0]))
    return spec, cost


def run(spec, cost, n, length, group, leaky):
    ab = (LeakyBudget if leaky else AdaptiveBudget)(cost, k=spec.k)
    lengths_fn, hook = grouped_policy(ab, n, group)
    return spec.generate(n, length, lengths_fn, step_hook=hook)


def test_leaky_budget_is_biased_on_the_paper_example():
    torch.manual_seed(0)
    spec, cost = paper_example()
    s = run(spec, cost, N_SAMPLES, 1, 1, leaky=True)
    assert abs((s[:, 0] == 0).mean() - 0.85) < 0.01  # the paper's biased law
    assert chi_square_pvalue(s, spec.exact(1)) < 1e-6


def test_adaptive_budget_is_lossless_on_the_paper_example():
    torch.manual_seed(1)
    spec, cost = paper_example()
    s = run(spec, cost, N_SAMPLES, 2, 1, leaky=False)
    exact = spec.exact(2)
    assert chi_square_pvalue(s[:, :1], marginal(exact, 1)) > 1e-3
    assert chi_square_pvalue(s, exact) > 1e-3


def test_adaptive_budget_is_lossless_with_shared_budgets():
    """Three requests share each budget, so which request gets the slots depends on current
    survivals across requests; the joint law of three tokens must still be the target's."""
    torch.manual_seed(2)
    P = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1], [0.2, 0.1, 0.3, 0.4], [0.6, 0.1, 0.1, 0.2]])
    Q = np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.1, 0.4], [0.5, 0.3, 0.1, 0.1], [0.1, 0.3, 0.5, 0.1]])
    spec = MicroSpec(P, Q, C=[0.95, 0.3, 0.7, 0.1], anchor=0, k=3)
    cost = CostModel(CostTable([1, 2, 3, 4, 6, 8, 12], [1.0, 1.0, 1.05, 1.1, 1.6, 1.9, 2.8], capture_limit=4),
                     CostTable([1, 4], [0.2, 0.3]))
    n = 3 * (N_SAMPLES // 3 + 1)
    s = run(spec, cost, n, 3, 3, leaky=False)
    lengths = np.concatenate(spec.length_log)
    assert len(np.unique(lengths)) >= 3  # the allocation really varies between requests/steps
    assert chi_square_pvalue(s, spec.exact(3)) > 1e-3


def _width_run(seed: int):
    """Three requests share each budget; each step drafts the width AdaptivePolicy.draft_width picks
    from the OLD confidences, the slots past it are not drafted (NaN to the policy, which keeps its
    old confidences there), and the allocation by the current confidences is capped at it.
    -> (samples of three tokens, spec, widths used, steps where the cap bound)."""
    from adaspec.spec_decode.policy import AdaptivePolicy, allocate, survival

    torch.manual_seed(seed)
    P = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1], [0.2, 0.1, 0.3, 0.4], [0.6, 0.1, 0.1, 0.2]])
    Q = np.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.1, 0.4], [0.5, 0.3, 0.1, 0.1], [0.1, 0.3, 0.5, 0.1]])
    spec = MicroSpec(P, Q, C=[0.95, 0.3, 0.7, 0.1], anchor=0, k=3)
    cost = CostModel(CostTable([1, 2, 3, 4, 6, 8, 12], [1.0, 1.0, 1.05, 1.1, 1.6, 1.9, 2.8], capture_limit=4),
                     CostTable([1, 4], [0.2, 0.3]))
    n, group = 3 * (N_SAMPLES // 3 + 1), 3
    pol = AdaptivePolicy(cost, 3)
    widths_used, bound, drafted_width = [], [0], np.full(n, 3)

    def lengths_fn(step, conf):
        out = np.empty(n, dtype=np.int64)
        for g in range(0, n, group):
            ids, cur = list(range(g, g + group)), conf[g:g + group]
            budget = pol.budget.budget(ids, group, group)
            w = pol.draft_width(ids, budget, np.full(group, 3), [1, 2, 3])
            drafted_width[g:g + group] = w
            out[g:g + group] = allocate(survival(cur), budget, np.full(group, w))
            bound[0] += int(not np.array_equal(out[g:g + group], allocate(survival(cur), budget)))
            widths_used.append(w)
        return out

    def observe(step, conf):
        seen = conf.astype(np.float64).copy()
        seen[np.arange(3)[None, :] >= drafted_width[:, None]] = np.nan  # slots not drafted
        pol.observe(list(range(n)), seen)

    return spec.generate(n, 3, lengths_fn, step_hook=observe), spec, widths_used, bound[0]


def test_budget_draft_width_stays_lossless_with_shared_budgets():
    """adaptive_draft_width "budget": the joint law of three tokens is the target's, with widths
    that vary and caps that bind (the current confidences would have allocated otherwise there). A cap
    taken from the current drafts could not bind at all (their own allocation fits under it), so
    the harness's negative control is the leaky budget above."""
    s, spec, widths, bound = _width_run(3)
    assert len(set(widths)) >= 2 and bound > 100
    assert chi_square_pvalue(s, spec.exact(3)) > 1e-3
