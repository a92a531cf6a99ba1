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


def test_plain_step_is_priced_by_the_plain_table():
    """A plain step of R decoding requests costs plain_ms(R), not verify_ms(R): with a cheap token
    table but expensive per-request decode steps, drafting wins; with cheap decode steps, it does not."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    verify = CostTable(sizes, [10.0 + 0.01 * s for s in sizes])
    draft = CostTable([1, 16], [5.0, 5.0])
    conf = np.full((16, 7), 0.9)
    ids = [f"r{i}" for i in range(16)]
    for plain_cost, expect in ((100.0, True), (10.0, False)):
        cm = CostModel(verify, draft, CostTable([1, 16], [plain_cost, plain_cost]))
        assert CostModel.from_dict(cm.to_dict()).to_dict() == cm.to_dict()
        p = AdaptivePolicy(cm, k=7)
        p.observe(ids, conf)
        assert p.should_draft(ids, 16, 16, [7] * 16) is expect
