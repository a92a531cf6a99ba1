"""Measured step costs (spec_decode/step_costs.py) and the adaptive policy's draft-or-not choice
with them, on a fake clock: the tokens per request per ms each kind of step really made decide,
once both kinds were measured at a batch-size bucket; probes of both kinds keep them fresh."""
import numpy as np
import pytest

from adaspec.spec_decode.cost_model import CostModel, CostTable
from adaspec.spec_decode.policy import AdaptiveBudget, AdaptivePolicy
from adaspec.spec_decode.step_costs import DRAFT, PLAIN, MeasuredStepCosts


def test_buckets_end_at_powers_of_two():
    b = MeasuredStepCosts.bucket
    assert [b(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 63, 64, 65, 255, 256, 257)] == \
        [0, 0, 1, 2, 2, 3, 3, 4, 4, 4, 5, 6, 6, 7, 8, 8, 9]


def test_rate_is_decayed_tokens_over_request_ms_per_kind_and_bucket_once_measured_enough():
    m = MeasuredStepCosts(alpha=0.5, min_samples=2, request_window=32)
    assert m.rate(DRAFT, 64) is None  # nothing measured: the tables decide
    m.observe(DRAFT, 64, 10.0, 192)  # 192 tokens over 64 requests in 10 ms: 0.3 per request per ms
    assert m.rate(DRAFT, 64) is None  # one sample is not enough
    m.observe(DRAFT, 40, 10.0, 40)  # same bucket (33-64), 0.1; the old sums kept at 1 - 0.5:
    assert m.rate(DRAFT, 64) == pytest.approx((0.5 * 192 + 40) / (0.5 * 640 + 400))  # not (0.3 + 0.1) / 2
    assert m.rate(PLAIN, 64) is None and m.rate(DRAFT, 32) is None  # kinds and buckets are separate
    m.observe(PLAIN, 8, 0.0, 8)  # no time: ignored
    m.observe(PLAIN, 0, 1.0, 8)  # no requests: ignored
    assert m.snapshot() == {DRAFT: {6: round(136 / 720, 4)}, PLAIN: {}}
    with pytest.raises(ValueError, match="step kind"):
        m.observe("verify", 1, 1.0, 1)
    with pytest.raises(ValueError, match="request_window"):
        MeasuredStepCosts(request_window=0)


def test_a_step_over_few_requests_weighs_in_proportion_to_them():
    """At one request a step's tokens are one draw (1 to 8 at T = 1): it moves the rate by
    1 / request_window of the sums; from request_window * alpha requests on, by alpha."""
    one = MeasuredStepCosts(alpha=0.3, min_samples=1, request_window=32)
    for _ in range(20):
        one.observe(DRAFT, 1, 2.0, 3)  # 1.5 tokens per ms
    one.observe(DRAFT, 1, 2.0, 1)  # one short step: 0.5
    kept = sum((1 - 1 / 32) ** i for i in range(1, 21))
    assert one.rate(DRAFT, 1) == pytest.approx((kept * 3 + 1) / ((kept + 1) * 2))  # 1.44; at alpha 0.3: 1.2
    many = MeasuredStepCosts(alpha=0.3, min_samples=1, request_window=32)
    for _ in range(20):
        many.observe(DRAFT, 64, 2.0, 192)
    many.observe(DRAFT, 64, 2.0, 64)
    kept = sum(0.7 ** i for i in range(1, 21))  # the 20 earlier steps' share of the sums
    assert many.rate(DRAFT, 64) == pytest.approx((kept * 192 + 64) / ((kept + 1) * 128))


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


def _drafted_step(policy, ids, clock, wall_ms, tokens):
    """One step that drafts (as the engine runs it), taking wall_ms, emitting `tokens`."""
    limits = np.full(len(ids), 7)
    policy.step_budget(ids, len(ids), len(ids), limits)
    policy.observe(ids, np.full((len(ids), 7), 0.6))
    policy.step_tokens(tokens)
    policy.step_started(clock.advance(wall_ms))


def _plain_steps(policy, n, clock, wall_ms, r=64):
    for _ in range(n):
        policy.plan_plain(r, r)
        policy.step_started(clock.advance(wall_ms))


@pytest.mark.parametrize("draft_ms, want_draft", [(20.0, False), (6.0, True)])
def test_the_kind_that_made_more_tokens_per_ms_decides(draft_ms, want_draft):
    """Drafting steps made 192 tokens for 64 requests; plain steps 64 in 4 ms (0.25 per request per
    ms). In 20 ms drafting makes 0.15: plain wins, whatever the tables say; in 6 ms 0.5: drafting."""
    ids = [f"r{i}" for i in range(64)]
    limits = np.full(64, 7)
    measured, tables = (AdaptivePolicy(_cost(), 7, probe_every=10**9, step_costs=c)
                        for c in (MeasuredStepCosts(), None))
    for policy in (measured, tables):
        clock = _Clock()
        policy.step_started(clock.t)
        for _ in range(3):
            _drafted_step(policy, ids, clock, draft_ms, 192)
        _plain_steps(policy, 3, clock, 4.0)
    assert measured.step_costs.rate(DRAFT, 64) == pytest.approx(192 / 64 / draft_ms)
    assert measured.step_costs.rate(PLAIN, 64) == pytest.approx(0.25)
    assert tables.should_draft(ids, 64, 64, limits)  # the tables alone price drafting as cheap
    assert measured.should_draft(ids, 64, 64, limits) == want_draft
    assert measured.should_draft([f"r{i}" for i in range(8)], 8, 8, np.full(8, 7))  # bucket 4: tables


def test_untimed_waited_and_idle_intervals_are_not_measured():
    policy = AdaptivePolicy(_cost(), 7, probe_every=10**9, step_costs=MeasuredStepCosts(min_samples=1))
    clock = _Clock()
    policy.step_started(clock.t)
    policy.plan_plain(8, 8, timed=False)  # the first of an async run
    policy.step_started(clock.advance(5.0))
    policy.plan_plain(8, 8)
    policy.step_started(clock.advance(50.0), measure_previous=False)  # the next step waited for it
    policy.plan_plain(8, 8)
    policy.idle()  # nothing was scheduled: the engine waited for requests
    policy.step_started(clock.advance(1000.0))
    policy.step_budget(["a"], 1, 1, np.array([7]))  # a drafting step whose tokens were never reported
    policy.step_started(clock.advance(3.0))
    policy.plan_plain(8, 200, tokens=5)  # prefill chunks ride along: only decode steps are compared
    policy.step_started(clock.advance(9.0))
    policy.step_budget(["a", "b"], 1, 60, np.array([7, 0]))
    policy.step_tokens(4)
    policy.step_started(clock.advance(9.0))
    assert policy.step_costs.samples == {}
    policy.plan_plain(8, 8, tokens=6)  # a fresh interval from the step after the idle one; 6 rows sampled
    policy.step_started(clock.advance(5.0))
    assert policy.step_costs.samples == {(PLAIN, 3): 1}
    assert policy.step_costs.rate(PLAIN, 8) == pytest.approx(6 / 8 / 5.0)


def test_plain_probes_interrupt_drafting_and_back_off_while_drafting_wins():
    """With measured costs a run of drafting decisions is interrupted every plain_probe_interval
    decisions by PLAIN_PROBE_STEPS plain steps (here the engine asks every step, as without async
    scheduling); each probe after which drafting still wins doubles the interval."""
    cheap = CostModel(CostTable([1, 8], [1.0, 1.0]), CostTable([1, 8], [0.01, 0.01]))
    policy = AdaptivePolicy(cheap, 7, probe_every=2, probe_max=8, step_costs=MeasuredStepCosts())
    n = AdaptivePolicy.PLAIN_PROBE_STEPS
    decisions = "".join("D" if policy.should_draft(["a"], 1, 1, np.array([7])) else "p" for _ in range(40))
    # drafts once, then the interval of 2 is reached: a plain probe; drafting wins (tables) after
    # it, so the next comes after 4 drafting decisions, then 8 (probe_max)
    p = "p" * n
    assert decisions == "D" + p + "DDD" + p + "DDDDDDD" + p + "DDDDDDD" + p + "DDDDDD"
    assert policy.plain_probe_interval == 8
    assert "p" * (n + 1) not in decisions  # never a longer plain run: drafting pays throughout
    # without measured costs there are no plain probes
    tables = AdaptivePolicy(cheap, 7, probe_every=2, probe_max=8)
    assert all(tables.should_draft(["a"], 1, 1, np.array([7])) for _ in range(40))


def test_plain_probe_under_async_scheduling_ends_after_its_steps():
    """Under async scheduling the engine asks should_draft once and then reports plain steps:
    plain_step_done asks for a decision again after the probe's last step."""
    cheap = CostModel(CostTable([1, 8], [1.0, 1.0]), CostTable([1, 8], [0.01, 0.01]))
    policy = AdaptivePolicy(cheap, 7, probe_every=2, probe_max=2, step_costs=MeasuredStepCosts())
    assert policy.should_draft(["a"], 1, 1, np.array([7]))
    assert not policy.should_draft(["a"], 1, 1, np.array([7]))  # the second drafting decision: a plain probe
    assert [policy.plain_step_done(1) for _ in range(AdaptivePolicy.PLAIN_PROBE_STEPS - 1)] == [False, False, True]
    assert policy.should_draft(["a"], 1, 1, np.array([7]))  # asked again: drafting (the tables) wins
    assert not policy.should_draft(["a"], 1, 1, np.array([7]))  # and the next probe, 2 decisions on


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


def _async_engine_kinds(policy, steps, r, draft_ms, draft_tokens, plain_ms):
    """The kinds of `steps` steps as LLMEngine._adaptive_async_step runs them (a drafting step reads
    back the plain step in flight first; a skipped step runs plain until plain_step_done asks
    again), on a fake clock where a drafting step takes draft_ms for draft_tokens (a number, or a
    function giving each step's) and a plain step plain_ms for one token per request."""
    ids, limits = [f"r{i}" for i in range(r)], np.full(r, 7)
    clock, kinds, draft_next, in_flight = _Clock(), [], True, False
    for _ in range(steps):
        policy.step_started(clock.t, measure_previous=not (draft_next and in_flight))
        if draft_next:
            in_flight = False
        decision = policy.should_draft(ids, r, r, limits) if draft_next else None
        if decision:
            _drafted_step_body(policy, ids, limits, draft_tokens() if callable(draft_tokens) else draft_tokens)
            clock.advance(draft_ms)
        else:
            policy.plan_plain(r, r, timed=in_flight, tokens=r)
            in_flight = True
            clock.advance(plain_ms)
        kinds.append("D" if decision else "p")
        draft_next = decision is not False if draft_next else policy.plain_step_done(r)
    return "".join(kinds)


@pytest.mark.parametrize("loop", ["async", "pipelined"])
def test_one_request_keeps_drafting_when_its_steps_yield_few_or_many_tokens(loop):
    """H100 run 62, one request at T = 1: a drafting step emitted 1-8 tokens (3.1 on average, sd
    2.0) in 2.06 ms, a plain step 1 in 1.19 ms, so drafting made ~1.5 tokens per ms against 0.84.
    An average of the last few steps' own rates fell below the plain rate after short runs of
    unlucky steps, and each such dip ran plain steps until the next probe: 37-48% of the decode
    steps ran plain. Averaged over enough request-steps (tokens over time, not a mean of per-step
    ratios), the rate stays above plain's and the policy drafts all but its plain probes."""
    rng = np.random.default_rng(0)

    def tokens():  # 1 + the drafts accepted in a row, each at 0.68, at most 7
        return 1 + int(np.argmin(np.append(rng.random(7) < 0.68, False)))

    policy = AdaptivePolicy(_cost(), 7, step_costs=MeasuredStepCosts())
    engine_kinds = _async_engine_kinds if loop == "async" else _pipelined_engine_kinds
    kinds = engine_kinds(policy, 2000, 1, draft_ms=2.06, draft_tokens=tokens, plain_ms=1.19)
    probes = kinds.replace("p" * AdaptivePolicy.PLAIN_PROBE_STEPS, "")
    assert probes.count("p") / len(probes) < 0.02, probes.count("p")
    assert kinds.count("p") / len(kinds) < 0.1, kinds.count("p")
    assert policy.step_costs.rate(DRAFT, 1) == pytest.approx(3.0 / 2.06, rel=0.15)


def _pipelined_engine_kinds(policy, steps, r, draft_ms, draft_tokens, plain_ms):
    """The kinds of `steps` steps as the pipelined engine runs them: should_draft asked every step,
    a drafting step planned by step_budget, the kind read back with planned_step_kind and timed by
    the engine itself (LLMEngine._time_spec_step: here draft_ms or plain_ms, as on a GPU-bound
    pipeline), with draft_tokens (a number or a function) or one token per request."""
    ids, limits = [f"r{i}" for i in range(r)], np.full(r, 7)
    kinds = []
    for _ in range(steps):
        drafting = policy.should_draft(ids, r, r, limits)
        if drafting:
            _drafted_step_body(policy, ids, limits, 0)  # (step_tokens: unused when pipelined)
        costed = policy.planned_step_kind()
        tokens = (draft_tokens() if callable(draft_tokens) else draft_tokens) if drafting else r
        if costed is not None:
            policy.step_costs.observe(*costed, draft_ms if drafting else plain_ms, tokens)
        kinds.append("D" if drafting else "p")
    return "".join(kinds)


def _drafted_step_body(policy, ids, limits, tokens):
    policy.step_budget(ids, len(ids), len(ids), limits)
    policy.observe(ids, np.full((len(ids), 7), 0.6))
    policy.step_tokens(tokens)


def test_a_bucket_explores_the_kind_the_tables_did_not_choose_ahead_of_the_probes():
    """Drafting looks cheap in the tables, but plain steps make more (0.25 against 0.15 tokens per
    request per ms): after the tables' first drafting step the policy runs a plain probe at once
    (not after probe_every drafting steps), and plain steps from the second drafting sample on."""
    policy = AdaptivePolicy(_cost(), 7, step_costs=MeasuredStepCosts())  # probe_every 16
    kinds = _async_engine_kinds(policy, 40, 64, draft_ms=20.0, draft_tokens=192, plain_ms=4.0)
    n = AdaptivePolicy.PLAIN_PROBE_STEPS
    assert kinds[: 1 + n + 1] == "D" + "p" * n + "D"  # tables, the plain probe, tables (draft not yet measured twice)
    assert "D" not in kinds[1 + n + 1: 1 + n + 1 + 14]  # then plain: the rates decide
    assert policy.step_costs.rate(PLAIN, 64) == pytest.approx(0.25)
    assert policy.step_costs.rate(DRAFT, 64) == pytest.approx(192 / 64 / 20.0)


def test_a_bucket_where_the_tables_skip_explores_drafting_once_plain_steps_are_timed():
    """The tables price drafting as ruinous, but drafting steps make 0.5 tokens per request per ms
    against plain's 0.25: once plain steps are measured, plain_step_done asks again and the policy
    drafts twice to measure drafting, then keeps drafting."""
    expensive = CostModel(CostTable([1, 512], [1.0, 1.0]), CostTable([1, 512], [1000.0, 1000.0]))
    policy = AdaptivePolicy(expensive, 7, step_costs=MeasuredStepCosts())
    kinds = _async_engine_kinds(policy, 30, 64, draft_ms=6.0, draft_tokens=192, plain_ms=4.0)
    # the tables' choice (two of its steps timed), drafting explored twice, plain steps until they
    # are measured twice (the one before a drafting step is not timed: that step waited for it),
    # then the rates decide: drafting, interrupted by plain probes only
    assert kinds.startswith("ppp" + "DD" + "ppp" + "D")
    n = AdaptivePolicy.PLAIN_PROBE_STEPS
    assert kinds[8:].replace("p" * n, "").count("p") == 0
    assert "p" * n in kinds[8:]  # (there was a plain probe in the 30 steps)
    assert policy.step_costs.rate(DRAFT, 64) == pytest.approx(0.5)


def test_a_rate_not_updated_for_max_age_measured_steps_is_forgotten_and_restarted():
    m = MeasuredStepCosts(alpha=0.5, min_samples=2, max_age=3)
    for _ in range(2):
        m.observe(DRAFT, 64, 10.0, 64)  # 0.1 per request per ms
    assert m.rate(DRAFT, 64) == pytest.approx(0.1)
    for _ in range(3):
        m.observe(PLAIN, 1, 1.0, 1)  # other steps: the draft rate at 64 ages
    assert m.rate(DRAFT, 64) == pytest.approx(0.1)  # 3 steps old: not yet stale
    m.observe(PLAIN, 1, 1.0, 1)
    assert m.rate(DRAFT, 64) is None and m.count(DRAFT, 64) == 0  # 4 steps old: forgotten
    m.observe(DRAFT, 64, 1.0, 64)  # 1.0: starts afresh, not averaged with the stale 0.1
    m.observe(DRAFT, 64, 1.0, 64)
    assert m.rate(DRAFT, 64) == pytest.approx(1.0)


@pytest.mark.parametrize("max_age", [16, 10**9])
def test_a_stale_rate_from_another_phase_is_measured_again_before_it_decides(max_age):
    """Drafting at 64 requests was measured poor (0.1) in an earlier phase; 40 steps at another
    batch size later it makes 0.5 against plain's 0.25. Forgotten after max_age steps, both kinds
    are measured afresh at once and drafting wins (the tables' drafting step, a plain probe, then
    drafting interrupted by plain probes only); kept, the stale average holds plain steps until
    probes have pulled it up."""
    costs = MeasuredStepCosts(max_age=max_age)
    for _ in range(2):
        costs.observe(DRAFT, 64, 10.0, 64)
        costs.observe(PLAIN, 64, 4.0, 64)
    for _ in range(40):
        costs.observe(PLAIN, 1, 1.0, 1)
    policy = AdaptivePolicy(_cost(), 7, step_costs=costs)
    kinds = _async_engine_kinds(policy, 48, 64, draft_ms=6.0, draft_tokens=192, plain_ms=4.0)
    n = AdaptivePolicy.PLAIN_PROBE_STEPS
    if max_age == 16:
        assert kinds.startswith("D" + "p" * n + "D"), kinds
        assert kinds.replace("p" * n, "").count("p") == 0, kinds
    else:
        assert kinds.count("D") <= 4, kinds


@pytest.mark.parametrize("slots, measured", [(7, True), (6, True), (5, False), (1, False)])
def test_a_drafting_step_whose_slots_max_tokens_capped_is_not_measured(slots, measured):
    """Requests near max_tokens draft into fewer slots and yield few tokens per step at any batch
    size: such a step (under 3/4 of the k slots free) does not stand for its bucket."""
    policy = AdaptivePolicy(_cost(), 7, probe_every=10**9, step_costs=MeasuredStepCosts(min_samples=1))
    clock = _Clock()
    policy.step_started(clock.t)
    ids = [f"r{i}" for i in range(8)]
    for planned in ("step_budget", "plan"):
        limits = np.full(8, slots)
        if planned == "step_budget":
            policy.step_budget(ids, 8, 8, limits)
        else:
            policy.plan(ids, np.full((8, 7), 0.6), 8, 8, limits)
        policy.step_tokens(16)
        policy.step_started(clock.advance(4.0))
    assert policy.step_costs.samples.get((DRAFT, 3), 0) == (2 if measured else 0)


def test_the_planned_step_kind_is_given_once_for_whole_decode_only_steps():
    """policy.planned_step_kind, read by the pipelined engine after each launch (it times the step
    itself, a step later): the kind of a whole decode-only step whose drafting slots are mostly
    free, once; nothing for a step with prompt chunks, a part of a split step, a capped one, or
    without measured step costs."""
    ids, free = [f"r{i}" for i in range(8)], np.full(8, 7)
    policy = AdaptivePolicy(_cost(), 7, probe_every=10**9, step_costs=MeasuredStepCosts())
    policy.step_budget(ids, 8, 8, free)
    assert policy.planned_step_kind() == (DRAFT, 8) and policy.planned_step_kind() is None
    policy.plan_plain(8, 8)
    assert policy.planned_step_kind() == (PLAIN, 8)
    policy.step_budget(ids, 8, 8, free)
    policy.plan_plain(8, 40)  # a later plan replaces an unread one: this one carries prompt chunks
    assert policy.planned_step_kind() is None
    policy.step_budget(ids, 8, 8, np.full(8, 1))  # slots capped by max_tokens
    assert policy.planned_step_kind() is None
    policy.step_budget(ids, 8, 8, free, whole=False)  # one part of a split step
    assert policy.planned_step_kind() is None
    tables = AdaptivePolicy(_cost(), 7, probe_every=10**9)
    tables.step_budget(ids, 8, 8, free)
    assert tables.planned_step_kind() is None


def test_a_skipped_step_with_a_row_out_of_slots_is_still_timed_over_all_its_rows():
    """The pipelined engine asks should_draft with the ids of the rows that have draft slots; a row
    whose max_tokens is near has none but samples in the step all the same. The skipped step is
    planned over every sampling row (8), not the 7 asked about, else it would look like a step of
    8 tokens over 7 requests, not a decode-only one, and plain steps would go unmeasured whenever
    a request is about to end."""
    expensive = CostModel(CostTable([1, 512], [1.0, 1.0]), CostTable([1, 512], [1000.0, 1000.0]))
    policy = AdaptivePolicy(expensive, 7, probe_every=10**9, step_costs=MeasuredStepCosts())
    assert not policy.should_draft([f"r{i}" for i in range(7)], 8, 8, np.full(7, 7))
    assert policy.planned_step_kind() == (PLAIN, 8)
