"""Online calibration of the adaptive budget's survivals (spec_decode/online_calibration.py):
the per-position ratio accepted / predicted against a brute-force count, the corrected survivals'
shape, the budget it moves, and the engine feeding it (greedy outputs stay the target's)."""
import numpy as np
import pytest

from adaspec import LLM, SamplingParams
from adaspec.errors import ConfigError
from adaspec.spec_decode.cost_model import CostModel, CostTable
from adaspec.spec_decode.online_calibration import SurvivalCorrection
from adaspec.spec_decode.policy import AdaptiveBudget, choose_budget, survival


def _brute(steps, k, decay):
    acc, pred = np.zeros(k), np.zeros(k)
    for lens, accepted, surv in steps:
        if len(lens) == 0:  # a step without drafted requests is not an observation
            continue
        acc, pred = acc * decay, pred * decay
        for r, n in enumerate(lens):
            for j in range(min(n, k)):
                pred[j] += surv[r][j]
                acc[j] += 1 if min(accepted[r], n) > j else 0
    return acc, pred


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_sums_match_a_brute_force_count(decay):
    rng = np.random.default_rng(1)
    k, steps = 5, []
    c = SurvivalCorrection(k, decay=decay, min_predicted=0.0)
    for _ in range(30):
        r = int(rng.integers(0, 6))
        lens = rng.integers(0, k + 1, r)
        accepted = rng.integers(0, k + 1, r)  # may exceed the verified count: only verified drafts count
        surv = survival(rng.uniform(0.3, 1.0, (r, k)))
        steps.append((lens, accepted, surv))
        c.update(lens, accepted, surv)
    acc, pred = _brute(steps, k, decay)
    np.testing.assert_allclose(c.accepted, acc)
    np.testing.assert_allclose(c.predicted, pred)
    np.testing.assert_allclose(c.factors(), np.clip(np.where(pred > 0, acc / np.maximum(pred, 1e-300), 1.0), 0.25, 4.0))


def test_no_evidence_changes_nothing_and_corrections_keep_survivals_valid():
    c = SurvivalCorrection(4, min_predicted=10.0)
    s = survival(np.full((3, 4), 0.9))
    np.testing.assert_array_equal(c.apply(s), s)  # nothing seen: factors 1
    # three requests promised 0.5 per slot: position 0 accepted by all (2x the promise), the rest
    # by one of three (2/3 of it)
    for _ in range(40):
        c.update([4, 4, 4], [4, 1, 1], np.full((3, 4), 0.5))
    f = c.factors()
    assert f[0] == pytest.approx(2.0) and f[1:] == pytest.approx([2 / 3] * 3)
    out = c.apply(s)
    assert (out >= 0).all() and (out <= 1).all()
    assert (np.diff(out, axis=1) <= 1e-12).all()  # a later draft never survives more often
    assert out[0, 0] == 1.0  # 0.9 x 2, clipped


def test_the_budget_follows_what_the_target_accepts():
    """Confidences that promise 0.9 per slot, a target that accepts far less: with the correction
    the budget verifies fewer drafts; without it, what the confidences say."""
    cost = CostModel(CostTable([1, 2, 4, 8, 16, 32, 64], [1.0, 1.0, 1.1, 1.3, 1.8, 3.0, 5.5]),
                     CostTable([1, 8], [0.3, 0.6]))
    ids = [f"r{i}" for i in range(8)]
    conf = np.full((8, 7), 0.9)
    plain = AdaptiveBudget(cost, 7)
    tracked = AdaptiveBudget(cost, 7, correction=SurvivalCorrection(7, min_predicted=5.0))
    for ab in (plain, tracked):
        ab.observe(ids, conf)
    for _ in range(20):  # every request verified all 7 and the target took only the first
        tracked.correction.update([7] * 8, [1] * 8, survival(conf))
    b_plain = plain.budget(ids, 8, 8)
    b_tracked = tracked.budget(ids, 8, 8)
    assert b_plain == choose_budget(survival(conf), 8, 8, 8, cost)  # what the confidences say
    assert b_tracked < b_plain
    assert b_tracked == choose_budget(tracked.correction.apply(survival(conf)), 8, 8, 8, cost)


def test_config_rejects_a_non_boolean():
    from adaspec.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="adaptive_verification_online_calibration"):
        SpeculativeConfig.from_dict({"method": "dspark", "adaptive_verification_online_calibration": "yes"})


@pytest.fixture(scope="module")
def pair(micro_pair):
    return micro_pair


def test_the_engine_feeds_the_correction_and_stays_lossless(pair, tmp_path):
    prompts = [[5 + i, 9, 17 + 2 * i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(pair[0]).generate(prompts, params)]
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 7, "enable_adaptive_verification": True,
           "adaptive_verification_online_calibration": True, "cost_model_cache_dir": str(tmp_path)}
    llm = LLM(pair[0], speculative_config=cfg)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    eng = llm.llm_engine
    correction = eng.spec.policy.budget.correction
    assert correction is not None and correction.predicted.sum() > 0
    # its evidence is the engine's calibration counters, discounted by its decay (so at most them)
    assert 0 < correction.accepted[0] <= eng.stats.accepted_per_pos[0] + 1e-9
    assert correction.predicted[0] <= eng.stats.predicted_accept_per_pos[0] + 1e-9
