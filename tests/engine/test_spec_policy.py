"""The engine's policies: fixed verifies every reserved slot; adaptive skips drafting when the
cost tables say a plain step yields more tokens per ms, with periodic probes."""
import numpy as np

from adaspec.engine.spec_policy import AdaptivePolicy, FixedPolicy
from adaspec.spec.cost_model import CostModel, CostTable


def _cost(draft_ms, verify_slope=1.0):
    sizes = [1, 2, 4, 8, 16, 32, 64]
    return CostModel(CostTable(sizes, [10 + verify_slope * s for s in sizes]),
                     CostTable([1, 2, 4, 8, 16, 32, 64], [draft_ms] * 7))


def test_fixed_policy_verifies_all_reserved_slots():
    p = FixedPolicy()
    assert p.should_draft(["a"], 1, 1, [7])
    assert p.plan(["a", "b"], np.full((2, 7), 0.1), 2, 2, np.array([7, 3])).tolist() == [7, 3]


def test_adaptive_skips_drafting_when_it_cannot_pay_and_probes():
    p = AdaptivePolicy(_cost(draft_ms=1000.0), k=7, probe_every=4)
    decisions = [p.should_draft(["a"], 1, 1, [7]) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]


def test_adaptive_drafts_when_drafting_is_cheap_and_confident():
    p = AdaptivePolicy(_cost(draft_ms=0.1, verify_slope=0.01), k=7)
    assert p.should_draft(["a"], 1, 1, [7])  # unknown request: survivals 1.0
    p.observe(["a"], np.full((1, 7), 0.9))
    assert p.should_draft(["a"], 1, 1, [7])
    lengths = p.plan(["a"], np.full((1, 7), 0.9), 1, 1, np.array([7]))
    assert lengths.tolist() == [7]
