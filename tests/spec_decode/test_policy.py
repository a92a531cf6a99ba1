"""Adaptive budget: prefixes, optimality against brute force, extremes, numpy == torch."""
import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaspec.spec_decode.cost_model import CostModel, CostTable
from adaspec.spec_decode.policy import (AdaptiveBudget, allocate, allocate_torch, apply_temperature, budget_objective,
                                 choose_budget, survival, survival_torch)

FAST = settings(max_examples=int(__import__("os").environ.get("SPEC_HYP_EXAMPLES", 60)), deadline=None)


@st.composite
def conf_matrix(draw, max_r=4, max_k=4):
    R = draw(st.integers(1, max_r))
    K = draw(st.integers(1, max_k))
    # a coarse value set forces ties; the continuous one exercises the general case
    val = st.one_of(st.sampled_from([0.25, 0.5, 1.0]), st.floats(1e-4, 1.0))
    return np.array(draw(st.lists(val, min_size=R * K, max_size=R * K))).reshape(R, K)


@st.composite
def cost_model(draw, max_tokens=40):
    def table(max_n):
        sizes = sorted(draw(st.sets(st.integers(1, max_n), min_size=1, max_size=8)) | {max_n})
        steps = draw(st.lists(st.floats(0.0, 5.0), min_size=len(sizes), max_size=len(sizes)))
        lim = draw(st.one_of(st.none(), st.sampled_from(sizes)))
        return CostTable(sizes, np.cumsum(steps) + 0.5, lim)

    return CostModel(table(max_tokens), table(8))


def ratio(a, lengths, n_sampling, base, cost):
    gain = n_sampling + sum(a[r, :l].sum() for r, l in enumerate(lengths))
    return gain / (cost.draft_ms(a.shape[0]) + cost.verify_ms(base + int(sum(lengths))))


def is_prefix_consistent(a, budget, lengths):
    return lengths.sum() == min(budget, a.size) and ((lengths >= 0) & (lengths <= a.shape[1])).all()


@FAST
@given(conf_matrix(), cost_model(), st.integers(0, 4), st.integers(1, 6))
def test_policy_matches_brute_force_over_prefix_vectors(conf, cost, n_sampling, base):
    a = survival(conf)
    R, K = a.shape
    b = choose_budget(a, n_sampling, base, R, cost)
    lengths = allocate(a, b)
    assert is_prefix_consistent(a, b, lengths)
    best = max(ratio(a, ls, n_sampling, base, cost) for ls in itertools.product(range(K + 1), repeat=R))
    assert np.isclose(ratio(a, lengths, n_sampling, base, cost), best, rtol=1e-9, atol=1e-12)
    # the objective array agrees with the chosen B, and B is the smallest maximizer
    obj = budget_objective(a, n_sampling, base, R, cost)
    assert obj[b] == obj.max() and (obj[:b] < obj[b]).all()


@FAST
@given(conf_matrix(max_r=8, max_k=7), st.integers(0, 40))
def test_allocation_admits_top_budget_as_prefixes(conf, budget):
    a = survival(conf)
    lengths = allocate(a, budget)
    assert is_prefix_consistent(a, budget, lengths)
    admitted = np.arange(a.shape[1])[None, :] < lengths[:, None]
    if admitted.any() and (~admitted).any():  # nothing left out beats anything admitted
        assert a[admitted].min() >= a[~admitted].max()


@FAST
@given(conf_matrix(max_r=8, max_k=7), st.integers(0, 60), st.booleans())
def test_numpy_and_torch_allocation_agree(conf, budget, as_tensor):
    """Same survivals, same allocation. The device computes them in float32, so the host's
    reference sorts the same float32 values: survivals 1e-9 apart in float64 tie in float32 and
    then go by index (both orders admit a prefix per request, as losslessness needs)."""
    a = survival(conf)
    at = survival_torch(torch.tensor(conf))
    assert np.allclose(at.numpy(), a)
    a = at.numpy().astype(np.float64)
    b = torch.tensor(budget) if as_tensor else budget
    assert allocate_torch(at, b).tolist() == allocate(a, budget).tolist()
    limits = np.random.default_rng(budget).integers(0, conf.shape[1] + 1, conf.shape[0])
    la = allocate(a, budget, limits)
    assert (la <= limits).all()
    assert allocate_torch(at, b, torch.tensor(limits)).tolist() == la.tolist()


@FAST
@given(conf_matrix(max_r=8, max_k=7), st.integers(0, 60))
def test_the_sorted_and_the_pairwise_rank_allocate_alike(conf, budget):
    """Above PAIRWISE_RANK_MAX slots allocate_torch ranks by a stable sort instead of counting
    pairs: both give the host's allocation (ties by index included)."""
    import adaspec.spec_decode.policy as policy

    at = survival_torch(torch.tensor(conf))
    limits = torch.tensor(np.random.default_rng(budget).integers(0, conf.shape[1] + 1, conf.shape[0]))
    want = allocate(at.numpy().astype(np.float64), budget, limits.numpy()).tolist()
    assert allocate_torch(at, budget, limits).tolist() == want
    saved = policy.PAIRWISE_RANK_MAX
    policy.PAIRWISE_RANK_MAX = 0  # every size sorts
    try:
        assert allocate_torch(at, budget, limits).tolist() == want
    finally:
        policy.PAIRWISE_RANK_MAX = saved


def test_allocation_agrees_at_a_float32_tie():
    conf = np.array([[0.5], [0.5 + 1e-9]])  # distinct in float64, equal in float32
    at = survival_torch(torch.tensor(conf))
    assert allocate_torch(at, 1).tolist() == allocate(at.numpy().astype(np.float64), 1).tolist() == [1, 0]


@FAST
@given(conf_matrix(max_r=6, max_k=6), st.data())
def test_admission_of_a_slot_ignores_the_later_slots_of_its_request(conf, data):
    """The lossless property: with B fixed, whether slot j of r is verified (l_r >= j) does not
    change when r's confidences from slot j+1 on (which depend on x_{r,j}) change."""
    R, K = conf.shape
    budget = data.draw(st.integers(0, R * K))
    r = data.draw(st.integers(0, R - 1))
    j = data.draw(st.integers(1, K))
    conf2 = conf.copy()
    conf2[r, j:] = data.draw(st.lists(st.floats(1e-4, 1.0), min_size=K - j, max_size=K - j))
    l1, l2 = allocate(survival(conf), budget)[r], allocate(survival(conf2), budget)[r]
    assert min(l1, j) == min(l2, j)


@FAST
@given(conf_matrix(max_r=6, max_k=7), cost_model(max_tokens=60), st.integers(1, 6))
def test_worthless_drafts_give_zero_budget(conf, cost, base):
    assert choose_budget(np.zeros_like(conf), conf.shape[0], base, conf.shape[0], cost) == 0


@FAST
@given(conf_matrix(max_r=6, max_k=7), st.integers(1, 6))
def test_tiny_confidences_with_rising_cost_give_zero_budget(conf, base):
    sizes = [1, 2, 4, 8, 16, 32, 64]
    cost = CostModel(CostTable(sizes, [1.0 + 0.1 * s for s in sizes]), CostTable([1, 8], [0.5, 1.0]))
    assert choose_budget(survival(conf * 1e-9), conf.shape[0], base, conf.shape[0], cost) == 0


@FAST
@given(conf_matrix(max_r=6, max_k=7), st.integers(1, 6), st.floats(0.0, 10.0))
def test_flat_verification_cost_verifies_everything(conf, base, draft):
    cost = CostModel(CostTable([1, 1000], [3.0, 3.0], capture_limit=None), CostTable([1], [draft]))
    a = survival(conf)
    b = choose_budget(a, conf.shape[0], base, conf.shape[0], cost)
    # every slot is worth verifying, except survivals too small to change the float sum (ties go
    # to the smaller budget)
    left_out = np.sort(a.ravel())[::-1][b:]
    assert b == a.size or left_out.sum() <= 1e-12 * (conf.shape[0] + a.sum())
    if b == a.size:
        assert (allocate(a, b) == conf.shape[1]).all()


def test_max_budget_caps_and_scalar_only_cost_functions_work():
    class ScalarCost:  # not vectorized: the policy falls back to element-wise calls
        def verify_ms(self, n):
            return 1.0 + 0.01 * int(n)

        def draft_ms(self, r):
            return 0.5

    a = survival(np.full((3, 4), 0.9))
    assert choose_budget(a, 3, 3, 3, ScalarCost()) == 12
    assert choose_budget(a, 3, 3, 3, ScalarCost(), max_budget=5) == 5


def test_survival_is_monotone_even_for_bad_inputs():
    c = np.array([[1.5, 0.5, np.nan, 2.0], [0.9, 1.0, 1.0, 0.1]])
    a = survival(c)
    assert (np.diff(a, axis=1) <= 0).all() and a[0].tolist() == [1.0, 0.5, 0.0, 0.0]
    assert np.allclose(survival_torch(torch.tensor(c)).numpy(), a)


def test_apply_temperature_numpy_and_torch():
    logits = np.array([[2.0, -1.0, 0.5]])
    temps = [2.0, 0.5, 1.0]
    want = 1 / (1 + np.exp(-logits / np.array(temps)))
    assert np.allclose(apply_temperature(logits, temps), want)
    assert np.allclose(apply_temperature(torch.tensor(logits), temps).numpy(), want, atol=1e-6)
    probs = 1 / (1 + np.exp(-logits))
    assert np.allclose(apply_temperature(probs, temps, is_logit=False), want, atol=1e-9)
    assert np.allclose(apply_temperature(logits, None), probs)


def _cost():
    return CostModel(CostTable([1, 2, 4, 8, 16, 32], [1.0, 1.0, 1.2, 1.6, 2.6, 4.8]), CostTable([1, 8], [0.3, 0.6]))


def test_adaptive_budget_uses_old_confidences_only():
    ab = AdaptiveBudget(_cost(), k=4)
    ids = ["a", "b"]
    rng = np.random.default_rng(0)
    # step 1: unknown requests count as survival 1.0, whatever the current drafts say
    l1 = ab.plan(ids, rng.uniform(0.01, 0.05, (2, 4)), 2, 2)
    b1 = ab.last_budget
    assert b1 == choose_budget(np.ones((2, 4)), 2, 2, 2, _cost())
    ab.plan(ids, rng.uniform(0.9, 1.0, (2, 4)), 2, 2)
    assert ab.last_budget == b1 and l1.sum() == b1
    ab.observe(ids, np.full((2, 4), 0.05))
    # step 2: the budget follows the stored confidences, allocation the current ones
    l2 = ab.plan(ids, np.array([[0.99] * 4, [0.01] * 4]), 2, 2)
    assert ab.last_budget == choose_budget(survival(np.full((2, 4), 0.05)), 2, 2, 2, _cost())
    assert l2[0] >= l2[1]
    ab.forget("a")
    assert "a" not in ab.last_conf


def test_adaptive_budget_ema_and_leaky_flag():
    ab = AdaptiveBudget(_cost(), k=2, ema_alpha=0.25)
    ab.observe(["x"], np.array([[0.8, 0.4]]))
    ab.observe(["x"], np.array([[0.4, 0.8]]))
    assert np.allclose(ab.last_conf["x"], [0.7, 0.5])
    from .leaky_budget import LeakyBudget

    leaky = LeakyBudget(_cost(), k=2)
    cur = np.array([[0.01, 0.01]])
    leaky.plan(["y"], cur, 1, 1)
    assert leaky.last_budget == choose_budget(survival(cur), 1, 1, 1, _cost())


def test_adaptive_budget_store_grows_and_reuses_rows_cleanly():
    ab = AdaptiveBudget(_cost(), k=3, ema_alpha=0.5)
    ids = [f"r{i}" for i in range(200)]  # more than the initial 64 rows
    conf = np.random.default_rng(0).uniform(0.1, 1.0, (200, 3))
    ab.observe(ids, conf)
    assert np.allclose(ab.old_confidences(ids), conf)
    ab.forget("r5")
    ab.observe(["new"], np.array([[0.2, 0.2]]))  # reuses r5's row; shorter K pads with 1.0
    assert np.allclose(ab.last_conf["new"], [0.2, 0.2, 1.0])  # no EMA with the old occupant
    assert np.allclose(ab.old_confidences(["r5", "r6"]), [[1.0] * 3, conf[6]])


@FAST
@given(conf_matrix(max_r=5, max_k=7), st.data())
def test_draft_width_holds_every_share_of_the_old_allocation(conf, data):
    """adaptive_draft_width "budget": the fewest widths that hold each request's share of the budget
    as the OLD confidences allocate it (brute force: the largest such share), k when none does."""
    from adaspec.spec_decode.policy import AdaptivePolicy

    R, k = conf.shape
    pol = AdaptivePolicy(_cost(), k)
    ids = [f"r{i}" for i in range(R)]
    pol.observe(ids, conf)
    budget = data.draw(st.integers(0, R * k))
    limits = np.array(data.draw(st.lists(st.integers(0, k), min_size=R, max_size=R)))
    widths = sorted(set(data.draw(st.lists(st.integers(1, k), min_size=1, max_size=3))) | {k})
    share = allocate(survival(conf), budget, limits)
    assert np.array_equal(share, np.array([min(l, v) for l, v in zip(limits, share)]))
    w = pol.draft_width(ids, budget, limits, widths)
    assert w in widths and w >= share.max() and all(x < share.max() for x in widths if x < w)


@st.composite
def narrow_cost_model(draw, k):
    """A cost model whose drafts of fewer slots have tables of their own (cheaper or not: the
    policy must price whatever was profiled)."""
    base = draw(cost_model(max_tokens=60))
    widths = sorted(draw(st.sets(st.integers(1, k - 1), max_size=3))) if k > 1 else []
    narrow = {w: CostTable([1, 8], sorted(draw(st.lists(st.floats(0.0, 6.0), min_size=2, max_size=2))))
              for w in widths}
    return CostModel(base.verify, base.draft, narrow)


@FAST
@given(conf_matrix(max_r=5, max_k=7), st.data())
def test_objective_weighs_every_draft_width_with_its_slots_capped(conf, data):
    """With narrow-draft tables, the objective at every B is the best over the draft widths w of
    (n + the B largest survivals among every request's first w slots) / (w's draft price +
    verify(T + B)), a width holding fewer than B slots not competing (brute force over w = 1..k,
    each priced as the cost model prices a draft holding w: the narrowest profiled width that does);
    the width reported for B is a profiled one that reaches it, no narrower profiled one does; the
    budget the policy picks is the smallest maximizer, and its draft width the objective's."""
    from adaspec.spec_decode.policy import AdaptivePolicy, width_capped_objective

    R, k = conf.shape
    cost = data.draw(narrow_cost_model(k))
    limits = np.array(data.draw(st.lists(st.integers(0, k), min_size=R, max_size=R)))
    n_sampling, base = data.draw(st.integers(0, 4)), data.draw(st.integers(1, 6))
    a = np.where(np.arange(k)[None, :] < limits[:, None], survival(conf), 0.0)

    def price(w):  # the narrowest profiled draft holding w slots, the full one where none does
        held = [x for x in cost.draft_narrow if x >= w]
        return cost.draft_narrow[min(held)].lookup(R) if held else cost.draft_ms(R)

    def rate(b, w):
        capped = np.sort(a[:, :w].ravel())[::-1]
        if b > capped.size:
            return -np.inf
        return (n_sampling + float(capped[:b].sum())) / (price(w) + cost.verify_ms(base + b))

    expected = [max(rate(b, w) for w in range(1, k + 1)) for b in range(R * k + 1)]
    obj, width, gain = width_capped_objective(a, n_sampling, base, R, cost)
    assert np.allclose(obj, expected, rtol=1e-9, atol=1e-12)
    profiled = sorted(cost.draft_narrow) + [k]
    for b in range(R * k + 1):
        w = int(width[b])
        assert w in profiled and np.isclose(rate(b, w), obj[b], rtol=1e-9, atol=1e-12)
        assert all(rate(b, x) < obj[b] * (1 - 1e-9) for x in profiled if x < w and price(x) < price(w))
        assert np.isclose(gain[b], obj[b] * (price(w) + cost.verify_ms(base + b)), rtol=1e-9, atol=1e-9)
    assert np.array_equal(budget_objective(a, n_sampling, base, R, cost), obj)
    b = choose_budget(a, n_sampling, base, R, cost)
    assert obj[b] == obj.max() and (obj[:b] < obj[b]).all()
    pol = AdaptivePolicy(cost, k)
    ids = [f"r{i}" for i in range(R)]
    pol.observe(ids, conf)
    assert pol.step_budget(ids, n_sampling, base, limits) == b
    assert pol.draft_width(ids, b, limits, profiled) == width[b]


def test_a_loaded_step_drafts_a_narrow_width_for_every_request_rather_than_the_full_one_for_a_few():
    """64 requests, 8 of them sure of every slot: by survival their deep slots rank above the
    others' second ones, so a budget allocated over all 7 slots needs the full draft; priced that
    way (the policy before width_capped_objective), a step that spreads its budget over 2 slots of
    every request was out of reach, and no budget beat a plain step: the old policy did not draft.
    Capped at 2 slots, the step verifies ~2 drafts of every request for a fifth of the draft's
    cost, at 1.5x the rate of any budget of the full draft and 1.33x a plain step's."""
    from adaspec.spec_decode.policy import AdaptivePolicy, width_capped_objective

    verify = CostTable([1, 64, 128, 192, 256, 512], [1.0, 2.0, 2.6, 3.4, 5.0, 9.0])
    cost = CostModel(verify, CostTable([1, 64], [0.5, 3.0]), {2: CostTable([1, 64], [0.2, 0.6])})
    conf = np.tile([0.9, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2], (64, 1))
    conf[:8] = 0.99
    a = survival(conf)
    obj, width, _ = width_capped_objective(a, 64, 64, 64, cost)
    b = int(np.argmax(obj))
    assert width[b] == 2 and 120 <= b <= 128
    full = budget_objective(a, 64, 64, 64, CostModel(verify, cost.draft))  # every B priced with 7 slots
    assert obj[b] > 1.4 * full.max() and obj[b] > 1.3 * 64 / verify.lookup(64)
    pol = AdaptivePolicy(cost, 7)
    ids = [f"r{i}" for i in range(64)]
    pol.observe(ids, conf)
    assert pol.should_draft(ids, 64, 64, np.full(64, 7))
    assert pol.step_budget(ids, 64, 64, np.full(64, 7)) == b
    w = pol.draft_width(ids, b, np.full(64, 7), [2, 4, 7])
    assert w == 2 and allocate(a, b, np.minimum(np.full(64, 7), w)).tolist() == [2] * (b - 64) + [1] * (128 - b)


def test_a_cheap_narrow_draft_makes_drafting_pay_where_the_full_one_does_not():
    """At a load where the full draft costs more than it yields, the narrow tables let the policy draft
    2 slots: from the tables alone, with old confidences."""
    from adaspec.spec_decode.policy import AdaptivePolicy

    verify = CostTable([1, 64, 128, 256], [1.0, 2.0, 2.6, 5.0])
    full = CostModel(verify, CostTable([1, 64], [0.5, 3.0]))
    narrow = CostModel(verify, full.draft, {2: CostTable([1, 64], [0.2, 0.6])})
    ids = [f"r{i}" for i in range(64)]
    conf = np.tile([0.9, 0.8, 0.2, 0.2, 0.1, 0.1, 0.1], (64, 1))
    decisions = []
    for cost in (full, narrow):
        pol = AdaptivePolicy(cost, 7)
        pol.observe(ids, conf)
        decisions.append(pol.should_draft(ids, 64, 64, np.full(64, 7)))
    assert decisions == [False, True]
    b = pol.step_budget(ids, 64, 64, np.full(64, 7))
    assert pol.draft_width(ids, b, np.full(64, 7), [2, 4, 7]) == 2 and 64 <= b <= 128


def test_observe_keeps_old_confidences_for_slots_not_drafted():
    """NaN = a slot the step did not draft (a narrower draft): the request keeps what it had there,
    a new request takes the population's, and the population moves on the drafted slots only."""
    ab = AdaptiveBudget(_cost(), k=3)
    ab.observe(["a", "b"], np.array([[0.9, 0.8, 0.7], [0.5, 0.4, 0.3]]))
    pop = ab.population.copy()
    ab.observe(["a", "c"], np.array([[0.6, np.nan, np.nan], [0.2, np.nan, np.nan]]))
    assert np.allclose(ab.last_conf["a"], [0.6, 0.8, 0.7])
    assert np.allclose(ab.last_conf["c"], [0.2, pop[1], pop[2]])
    assert np.allclose(ab.population[1:], pop[1:]) and not np.isclose(ab.population[0], pop[0])
    assert not np.isnan(ab.old_confidences(["a", "b", "c"])).any()


def test_draft_width_leaves_out_worthless_slots_and_drafts_everything_now_and_then():
    """Slots of survival 0 do not widen the draft (the objective's pricing leaves them out too), and
    every FULL_WIDTH_EVERY-th call drafts all k slots, so slots past a narrow width are seen again."""
    from adaspec.spec_decode.policy import AdaptivePolicy

    pol = AdaptivePolicy(_cost(), 7)
    ids = ["a", "b"]
    pol.observe(ids, np.array([[0.9, 0.8, 0.0, 0.5, 0.5, 0.5, 0.5]] * 2))  # nothing survives past slot 2
    limits = np.full(2, 7)
    widths = [pol.draft_width(ids, 14, limits, [2, 4, 7]) for _ in range(2 * AdaptivePolicy.FULL_WIDTH_EVERY)]
    full = [i for i, w in enumerate(widths) if w == 7]
    assert set(widths) == {2, 7} and full == [AdaptivePolicy.FULL_WIDTH_EVERY - 1, 2 * AdaptivePolicy.FULL_WIDTH_EVERY - 1]


def test_new_requests_at_the_population_average_do_not_tip_a_loaded_step_into_drafting():
    """Steady arrivals: 240 requests whose drafts pay less than a plain step, and 16 new ones. At
    1.0 per slot (unobserved "one", vLLM's) the new rows promise 7 tokens each and the step drafts;
    at the population's average ("population") it stays plain, as it does without the new rows."""
    from adaspec.spec_decode.policy import AdaptivePolicy

    verify = CostTable([1, 64, 256, 512, 2048], [1.0, 1.2, 2.0, 2.6, 8.0])
    cost = CostModel(verify, CostTable([1, 256], [0.1, 0.3]))
    old = [f"r{i}" for i in range(240)]
    new = [f"n{i}" for i in range(16)]
    conf = np.tile([0.4, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1], (240, 1))
    decisions = {}
    for unobserved in ("one", "population"):
        pol = AdaptivePolicy(cost, 7, unobserved=unobserved)
        pol.observe(old, conf)
        assert not pol.should_draft(old, 240, 240, np.full(240, 7))  # the old rows alone: plain
        decisions[unobserved] = pol.should_draft(old + new, 256, 256, np.full(256, 7))
    assert decisions == {"one": True, "population": False}
    assert AdaptivePolicy(cost, 7).budget.unknown == "one"  # the default without measured step costs
    # fused mixed steps: the chunk steps it runs plain leave a whole wave of requests unobserved
    assert AdaptivePolicy(cost, 7, mixed_steps="fused").budget.unknown == "population"
    assert AdaptivePolicy(cost, 7, mixed_steps="fused", unobserved="one").budget.unknown == "one"  # as configured
