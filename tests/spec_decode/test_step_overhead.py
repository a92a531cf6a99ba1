"""The step overhead the adaptive policy can add to its cost tables (spec_decode/step_overhead.py):
the tracker with fake timings (no clock), the priced costs, the budget's response to it, and the
speculative_config key."""
import numpy as np
import pytest

from adaspec import LLM, SamplingParams
from adaspec.errors import ConfigError
from adaspec.spec_decode.policy import AdaptivePolicy, choose_budget, step_verify_ms
from adaspec.spec_decode.step_overhead import OverheadCost, StepOverhead


class Tables:
    """draft 1 ms + 0.01 ms per request; verify 2 ms + 0.02 ms per token, vectorized."""

    def draft_ms(self, r):
        return 1.0 + 0.01 * r

    def verify_ms(self, n):
        return 2.0 + 0.02 * np.asarray(n, dtype=np.float64)


class PaddedTables(Tables):
    """As a GraphPaddedCost: prices per (requests, tokens), padding tokens up to a multiple of 8."""

    def verify_ms_for(self, r, tokens):
        return self.verify_ms(-(-np.asarray(tokens) // 8) * 8)


def test_fixed_and_measured_overhead():
    assert StepOverhead(2.5).value == 2.5
    fixed = StepOverhead(2.5)
    fixed.observe(100.0, 1.0)
    assert fixed.value == 2.5  # a fixed value is not measured
    m = StepOverhead("measured", alpha=0.5)
    assert m.value == 0.0
    m.observe(10.0, 4.0)
    assert m.value == 6.0  # the first sample is taken as is
    m.observe(6.0, 4.0)
    assert m.value == pytest.approx(0.5 * 2.0 + 0.5 * 6.0)
    m.observe(1.0, 4.0)  # faster than the tables: a negative sample, averaged as it is
    assert m.value == pytest.approx(0.5 * -3.0 + 0.5 * 4.0) and m.samples == 3
    assert m.signed == m.value and m.floored == 1
    m.observe(-20.0, 4.0)  # the average goes negative: priced at 0, the average kept
    assert m.value == 0.0 and m.signed == pytest.approx(0.5 * -24.0 + 0.5 * 0.5) and m.floored == 2
    # the rule before H100 run 74's finding (each sample floored at 0), recorded, not priced
    assert m.per_sample_floored == pytest.approx(0.5 * 0.0 + 0.5 * (0.5 * 0.0 + 0.5 * 4.0))
    assert m.snapshot() == {"ms": 0.0, "signed_ms": -11.75, "samples": 4, "floored": 2, "per_sample_floored_ms": 1.0}
    for bad in (-1.0, "fast", None, True):
        with pytest.raises(ValueError, match="step overhead"):
            StepOverhead(bad)


@pytest.mark.parametrize("tables", [Tables(), PaddedTables()], ids=["plain", "padded"])
def test_overhead_is_added_to_every_verify_price_and_not_to_drafting(tables):
    cost = OverheadCost(tables, StepOverhead(3.0))
    tokens = np.array([1, 9, 64, 300])
    np.testing.assert_allclose(step_verify_ms(cost, 16, tokens), step_verify_ms(tables, 16, tokens) + 3.0)
    assert float(cost.verify_ms(40)) == pytest.approx(float(tables.verify_ms(40)) + 3.0)
    assert cost.draft_ms(16) == tables.draft_ms(16)


def test_budget_never_shrinks_as_the_overhead_grows():
    """For B2 > B1, B2 wins iff overhead * (gain2 - gain1) > gain1 * cost2 - gain2 * cost1: a larger
    overhead can only move B* up. Checked on random survivals and steep tables, where it moves."""
    rng = np.random.default_rng(0)
    moved = 0
    for case in range(200):
        r, k = int(rng.integers(1, 40)), int(rng.integers(1, 8))
        a = np.minimum.accumulate(np.cumprod(rng.uniform(0.2, 1.0, (r, k)), axis=1), axis=1)
        tables = Tables() if case % 2 else PaddedTables()
        budgets = [choose_budget(a, r, r, r, OverheadCost(tables, StepOverhead(o))) for o in (0.0, 1.0, 5.0, 50.0)]
        assert budgets == sorted(budgets), (case, budgets)
        moved += budgets[-1] > budgets[0]
    assert moved > 50  # the overhead matters in most cases, not only at the edges


def test_policy_measures_the_overhead_of_the_steps_it_planned():
    tables = Tables()
    policy = AdaptivePolicy(tables, k=4, overhead=StepOverhead("measured", alpha=1.0))
    ids, limits = ["a", "b"], np.array([4, 4])
    policy.observe_step(50.0)  # a step the policy did not plan: ignored
    assert policy.overhead.samples == 0
    assert policy.should_draft(ids, 2, 2, limits)  # unknown requests count as confidence 1: drafting pays
    b = policy.step_budget(ids, 2, 2, limits)
    predicted = float(tables.draft_ms(2)) + float(tables.verify_ms(2 + b))
    policy.observe_step(predicted + 7.0)
    assert policy.overhead.value == pytest.approx(7.0)
    # the overhead now prices every candidate: the same objective with 7 ms added to the tables
    assert policy.budget.budget(ids, 2, 2, limits=limits) == choose_budget(
        np.ones((2, 4)), 2, 2, 2, OverheadCost(tables, StepOverhead(7.0)))


class NarrowTables(Tables):
    """Drafts of at most 2 slots cost 0.25 ms (cost_model.CostModel.draft_ms_width's contract)."""

    prices_widths = True

    def draft_ms_width(self, r, need):
        need = np.asarray(need)
        return np.where(need <= 2, 0.25, self.draft_ms(r))


def test_a_narrow_step_is_measured_against_the_narrow_draft_it_ran():
    """adaptive_draft_width "budget": the overhead of a step that drafted 2 slots is its wall time
    less the 2-slot draft's price, not the full draft's."""
    tables = NarrowTables()
    policy = AdaptivePolicy(tables, k=4, overhead=StepOverhead("measured", alpha=1.0))
    ids, limits = ["a", "b"], np.array([4, 4])
    policy.observe(ids, np.array([[0.9, 0.9, 0.01, 0.01]] * 2))
    assert policy.should_draft(ids, 2, 2, limits)
    b = policy.step_budget(ids, 2, 2, limits)
    assert policy.draft_width(ids, b, limits, [2, 4]) == 2
    policy.observe_step(0.25 + float(tables.verify_ms(2 + b)) + 3.0)
    assert policy.overhead.value == pytest.approx(3.0)


def test_alternating_long_and_short_steps_leave_the_priced_value_near_the_true_overhead():
    """A step launched behind a long one carries its time (the pipelined step is timed launch to
    launch), while the long one's own interval is short: the samples alternate around the true
    overhead (0 here). Flooring each sample kept only the positive ones (H100 run 74: 10.7 ms on the
    Qwen3-8B shape); the value priced is the floor of the signed average, near 0."""
    m = StepOverhead("measured", alpha=0.1)
    for _ in range(200):
        m.observe(wall_ms=10.0, predicted_ms=110.0)  # the chunk step: launched, the next at once
        m.observe(wall_ms=150.0, predicted_ms=50.0)  # the step behind it: both steps' GPU time
    assert m.value < 6.0 and m.per_sample_floored > 40.0 and m.floored == 200 and m.samples == 400
    # with a true overhead of 3 ms on both kinds the value finds it within the alternation's ripple
    m = StepOverhead("measured", alpha=0.1)
    for _ in range(200):
        m.observe(wall_ms=13.0, predicted_ms=110.0)
        m.observe(wall_ms=153.0, predicted_ms=50.0)
    assert 3.0 - 6.0 < m.signed < 3.0 + 6.0 and m.value == max(0.0, m.signed)


def test_policy_measures_a_step_without_drafts_against_a_plain_verify():
    tables = Tables()
    policy = AdaptivePolicy(tables, k=2, probe_every=100, overhead=StepOverhead("measured", alpha=1.0))
    policy.observe(["a"], np.array([[0.0, 0.0]]))  # a request whose drafts never survive
    assert not policy.should_draft(["a"], 1, 1, np.array([2]))
    policy.observe_step(float(tables.verify_ms(1)) + 4.0)
    assert policy.overhead.value == pytest.approx(4.0)


@pytest.mark.parametrize("bad", [-1, "sometimes", True, [1.0]])
def test_config_rejects_a_bad_overhead(bad):
    with pytest.raises(ConfigError, match="adaptive_verification_step_overhead_ms"):
        LLM("tiny", device="cpu", speculative_config={"method": "dspark", "enable_adaptive_verification": True,
                                                      "adaptive_verification_step_overhead_ms": bad})


def test_engine_with_a_measured_overhead_stays_lossless_greedy(tmp_path):
    """"measured" learns the overhead in a running engine; the default (0) keeps the tables alone,
    and testing.pin_cost_tables pins it so that no test's policy follows the machine's load."""
    from adaspec.testing import pin_cost_tables

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["def add(a, b):", "import os\n", "class Point:"]
    plain = [o.outputs[0].token_ids for o in LLM("tiny", device="cpu").generate(prompts, params)]
    cfg = {"method": "dspark", "num_speculative_tokens": 4, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path), "profile_repeats": 1}
    llm = LLM("tiny", device="cpu", speculative_config={**cfg, "adaptive_verification_step_overhead_ms": "measured"})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    overhead = llm.llm_engine.spec.policy.overhead
    assert overhead.measured and overhead.samples > 0 and overhead.value >= 0
    pin_cost_tables(llm)
    llm.generate(prompts, params)
    assert not llm.llm_engine.spec.policy.overhead.measured and llm.llm_engine.spec.policy.overhead.value == 0.0
    tables_alone = LLM("tiny", device="cpu", speculative_config=cfg)  # the default
    assert not tables_alone.llm_engine.spec.policy.overhead.measured
    assert tables_alone.llm_engine.spec.policy.overhead.value == 0.0
