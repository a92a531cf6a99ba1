"""Measured step costs (spec_decode/step_costs.py) and the adaptive policy's draft-or-not choice
with them, on a fake clock: what each kind of step really took against its tables decides."""
import numpy as np
import pytest

from adaspec.spec_decode.cost_model import CostModel, CostTable
from adaspec.spec_decode.policy import AdaptiveBudget, AdaptivePolicy
from adaspec.spec_decode.step_costs import DRAFT, PLAIN, MeasuredStepCosts


def test_buckets_are_powers_of_two():
    b = MeasuredStepCosts.bucket
    assert [b(n) for n in (0, 1, 2, 3, 4, 7, 8, 255, 256, 511)] == [1, 1, 2, 2, 3, 3, 4, 8, 9, 9]


def test_ratio_is_an_average_per_kind_and_bucket_with_nearest_fallback():
    m = MeasuredStepCosts(alpha=0.5, clip=(0.25, 10.0))
    assert m.scale(DRAFT, 64) == 1.0  # nothing measured: the tables alone
    m.observe(DRAFT, 64, 30.0, 10.0)
    assert m.scale(DRAFT, 64) == pytest.approx(3.0)
    m.observe(DRAFT, 100, 10.0, 10.0)  # same bucket (64-127): 0.5 * 1 + 0.5 * 3
    assert m.scale(DRAFT, 64) == pytest.approx(2.0)
    assert m.scale(PLAIN, 64) == 1.0  # kinds are separate
    assert m.scale(DRAFT, 1) == pytest.approx(2.0)  # nearest measured bucket
    m.observe(DRAFT, 4, 500.0, 1.0)  # clipped to 10
    assert m.scale(DRAFT, 4) == pytest.approx(10.0)
    assert m.scale(DRAFT, 16) == pytest.approx(10.0)  # bucket 5: 3 away from 64's 7, 2 from 4's 3
    m.observe(DRAFT, 8, 1.0, 0.0)  # nothing priced: ignored
    assert m.snapshot() == {DRAFT: {3: 10.0, 7: 2.0}, PLAIN: {}}
    with pytest.raises(ValueError, match="step kind"):
        m.observe("verify", 1, 1.0, 1.0)


def _cost():
    """Drafting looks cheap in the tables: 1 ms to draft for anyone, verification flat-ish."""
    sizes = [1, 8, 64, 512]
    return CostModel(CostTable(sizes, [2.0 + 0.002 * s for s in sizes]), CostTable([1, 64], [1.0, 1.0]))


class _Clock:
    def __init__(self):
        self.t = 0.0

    def advance(self, ms):
        self.t += ms / 1e3
        return self.t


def _drafted_step(policy, ids, clock, wall_ms):
    """One step that drafts (as the engine runs it), taking wall_ms."""
    limits = np.full(len(ids), 7)
    policy.step_budget(ids, len(ids), len(ids), limits)
    policy.observe(ids, np.full((len(ids), 7), 0.6))
    policy.step_started(clock.advance(wall_ms))


def test_drafted_steps_that_cost_more_than_priced_turn_the_policy_to_plain_steps():
    ids = [f"r{i}" for i in range(64)]
    limits = np.full(64, 7)
    measured, tables = (AdaptivePolicy(_cost(), 7, probe_every=10**9, step_costs=c)
                        for c in (MeasuredStepCosts(), None))
    for policy in (measured, tables):
        clock = _Clock()
        policy.step_started(clock.t)
        for _ in range(10):  # priced at ~3.6 ms, each took 20 ms
            _drafted_step(policy, ids, clock, 20.0)
    assert measured.step_costs.scale(DRAFT, 64) > 4
    assert tables.should_draft(ids, 64, 64, limits)  # the tables alone never see it
    assert not measured.should_draft(ids, 64, 64, limits)


def test_plain_steps_that_cost_more_than_priced_turn_it_back():
    ids = [f"r{i}" for i in range(64)]
    limits = np.full(64, 7)
    policy = AdaptivePolicy(_cost(), 7, probe_every=10**9, step_costs=MeasuredStepCosts())
    clock = _Clock()
    policy.step_started(clock.t)
    for _ in range(10):
        _drafted_step(policy, ids, clock, 20.0)
    assert not policy.should_draft(ids, 64, 64, limits)  # this step runs plain, not measured (the first of
    policy.plan_plain(64, 64, timed=False)                # a run under async scheduling)  # first of a run: not measured
    policy.step_started(clock.advance(1.0))
    assert PLAIN not in {k for k, _ in policy.step_costs.ratio}
    for _ in range(10):  # plain steps priced at ~2.1 ms took 30 ms each
        policy.plan_plain(64, 64)
        policy.step_started(clock.advance(30.0))
    assert policy.step_costs.scale(PLAIN, 64) > 10
    assert policy.should_draft(ids, 64, 64, limits)


def test_waited_and_idle_intervals_are_not_measured():
    policy = AdaptivePolicy(_cost(), 7, probe_every=10**9, step_costs=MeasuredStepCosts())
    clock = _Clock()
    policy.step_started(clock.t)
    policy.plan_plain(8, 8)
    policy.step_started(clock.advance(50.0), measure_previous=False)  # the next step waited for it
    policy.plan_plain(8, 8)
    policy.idle()  # nothing was scheduled: the engine waited for requests
    policy.step_started(clock.advance(1000.0))
    assert policy.step_costs.samples == {}
    policy.plan_plain(8, 8)  # a fresh interval from the step after the idle one
    policy.step_started(clock.advance(5.0))
    assert policy.step_costs.samples == {(PLAIN, 4): 1}
    assert policy.step_costs.scale(PLAIN, 8) == pytest.approx(5.0 / (2.0 + 0.002 * 8))


def test_probes_announced_after_plain_steps_draft_the_next_step():
    """Under async scheduling a skipped step is followed by plain steps the engine runs without
    asking (plain_step_done counts them); every probe_every-th step drafts, paying or not."""
    expensive = CostModel(CostTable([1, 8], [1.0, 1.0]), CostTable([1, 8], [1000.0, 1000.0]))
    policy = AdaptivePolicy(expensive, 7, probe_every=4, step_costs=MeasuredStepCosts(), probe_max=4)
    ids, limits = ["a"], np.array([7])
    decisions, draft_mode = [], True
    for _ in range(12):
        if draft_mode:  # the engine asks; a skipped step then runs plain
            drafts = policy.should_draft(ids, 1, 1, limits)
            draft_mode = drafts
        else:
            drafts = False
            draft_mode = policy.plain_step_done()
        decisions.append(drafts)
    assert decisions == [False, False, False, True, False, False, False, True, False, False, False, True]


def test_unknown_requests_count_as_the_population_average():
    ab = AdaptiveBudget(_cost(), 3, unknown="population")
    assert ab.old_confidences(["new"]).tolist() == [[1.0] * 3]  # nothing seen yet
    ab.observe(["a", "b"], np.array([[0.2, 0.4, 0.6], [0.4, 0.6, 0.8]]))
    np.testing.assert_allclose(ab.old_confidences(["new", "a"]), [[0.3, 0.5, 0.7], [0.2, 0.4, 0.6]])
    ab.observe(["c"], np.array([[0.8, 0.8, 0.8]]))  # an average over steps: 0.2 * new + 0.8 * old
    np.testing.assert_allclose(ab.old_confidences(["new"]), [[0.4, 0.56, 0.72]])
    assert AdaptiveBudget(_cost(), 3).old_confidences(["new"]).tolist() == [[1.0] * 3]  # default: 1.0
    with pytest.raises(ValueError, match="unknown"):
        AdaptiveBudget(_cost(), 3, unknown="zero")
