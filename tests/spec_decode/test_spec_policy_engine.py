"""The engine's policies: fixed verifies every reserved slot; adaptive skips drafting when the
cost tables say a plain step yields more tokens per ms, with periodic probes."""
import numpy as np

from adaspec.spec_decode.policy import AdaptivePolicy, FixedPolicy
from adaspec.spec_decode.cost_model import CostModel, CostTable


def _cost(draft_ms, verify_slope=1.0):
    sizes = [1, 2, 4, 8, 16, 32, 64]
    return CostModel(CostTable(sizes, [10 + verify_slope * s for s in sizes]),
                     CostTable([1, 2, 4, 8, 16, 32, 64], [draft_ms] * 7))


def test_fixed_policy_verifies_all_reserved_slots():
    p = FixedPolicy()
    assert p.should_draft(["a"], 1, 1, [7])
    assert p.plan(["a", "b"], np.full((2, 7), 0.1), 2, 2, np.array([7, 3])).tolist() == [7, 3]


def test_adaptive_skips_drafting_when_it_cannot_pay_and_probes():
    p = AdaptivePolicy(_cost(draft_ms=1000.0), k=7, probe_every=4, probe_max=4)
    decisions = [p.should_draft(["a"], 1, 1, [7]) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]


def test_probes_that_still_skip_double_the_interval_up_to_probe_max():
    """Each probe after which drafting still does not pay doubles the steps to the next one (a probe
    at high load costs many plain steps), up to probe_max."""
    p = AdaptivePolicy(_cost(draft_ms=1000.0), k=7, probe_every=2, probe_max=8)
    decisions = [p.should_draft(["a"], 1, 1, [7]) for _ in range(30)]
    probes = [i + 1 for i, d in enumerate(decisions) if d]
    assert probes == [2, 6, 14, 22, 30]  # every 2 steps, then 4, then 8 (probe_max)
    assert p.probe_interval == 8


def test_a_step_that_pays_or_a_load_that_moves_restores_the_shortest_interval():
    # drafting pays with confident drafts (8 tokens for 19 ms against 1 for 10.5), not with hopeless ones
    p = AdaptivePolicy(_cost(draft_ms=5.0, verify_slope=0.5), k=7, probe_every=2, probe_max=64)
    p.observe(["a"], np.full((1, 7), 0.01))
    decisions = [p.should_draft(["a"], 1, 1, [7]) for _ in range(20)]
    assert not all(decisions) and p.probe_interval > 2
    p.observe(["a"], np.full((1, 7), 0.99))  # the probe's drafts were good after all
    p.budget.forget("a")
    p.observe(["a"], np.full((1, 7), 0.99))
    assert p.should_draft(["a"], 1, 1, [7]) and p.probe_interval == 2
    # async scheduling: the engine counts its plain steps with plain_step_done; a load 1.5x away from
    # the one last decided for makes the next step ask again, at the shortest interval
    p = AdaptivePolicy(_cost(draft_ms=1000.0), k=7, probe_every=2, probe_max=64)
    ids = [f"r{i}" for i in range(10)]
    assert not p.should_draft(ids, 10, 10, np.full(10, 7))
    p.probe_interval = 64
    assert not p.plain_step_done(12)  # within 1.5x of the 10 requests decided for
    assert p.plain_step_done(16) and p.probe_interval == 2
    p.probe_interval = 64
    assert p.plain_step_done(6) and p.probe_interval == 2



def test_adaptive_drafts_when_drafting_is_cheap_and_confident():
    p = AdaptivePolicy(_cost(draft_ms=0.1, verify_slope=0.01), k=7)
    assert p.should_draft(["a"], 1, 1, [7])  # unknown request: survivals 1.0
    p.observe(["a"], np.full((1, 7), 0.9))
    assert p.should_draft(["a"], 1, 1, [7])
    lengths = p.plan(["a"], np.full((1, 7), 0.9), 1, 1, np.array([7]))
    assert lengths.tolist() == [7]


def test_plan_reuses_should_draft_budget_and_matches_a_fresh_search():
    """plan() after should_draft() allocates with the B* should_draft found; it must equal what
    AdaptiveBudget computes from scratch for the same old and current confidences."""
    from adaspec.spec_decode.policy import AdaptiveBudget

    rng = np.random.default_rng(0)
    cost = _cost(draft_ms=2.0, verify_slope=0.5)
    checked = 0
    for _ in range(50):
        R = int(rng.integers(1, 9))
        ids = [f"r{i}" for i in range(R)]
        old, now = rng.uniform(0.05, 1, (R, 7)), rng.uniform(0.05, 1, (R, 7))
        limits = rng.integers(1, 8, R)
        p, ref = AdaptivePolicy(cost, k=7, probe_every=10**9), AdaptiveBudget(cost, 7)
        p.observe(ids, old)
        ref.observe(ids, old)
        if p.should_draft(ids, R, R, limits):
            got = p.plan(ids, now, R, R, limits)
            want = ref.plan(ids, now, R, R, limits=limits)
            assert got.tolist() == want.tolist()
            assert p.budget.last_budget == ref.last_budget
            checked += 1
    assert checked >= 10  # the drafting branch was really exercised
