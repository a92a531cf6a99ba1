"""adaptive_verification_mixed_steps "fused": a step that carries prompt chunks is judged at the
margin (policy.mixed_step_drafts) and, when it does not draft, runs as one forward with the chunks.
The decision against a brute force from first principles, its agreement with the decode-only rule
when there is nothing to fuse, the policy's use of it, and the engine's outputs (the target's)."""
import numpy as np
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.config import SpeculativeConfig
from adaspec.errors import ConfigError
from adaspec.spec_decode.cost_model import CostModel, CostTable
from adaspec.spec_decode.policy import (AdaptivePolicy, allocate, budget_objective, mixed_step_drafts, mixed_step_terms,
                                        survival)
from adaspec.spec_decode.step_costs import DRAFT, PLAIN, MeasuredStepCosts
from adaspec.spec_decode.step_overhead import OverheadCost, StepOverhead
from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir, use_eager_spec_graphs

SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def _knee_cost(flat_ms=10.0, knee=64, slope=0.5, draft_ms=1.0):
    """A GPU-like verify cost: flat (memory-bound) up to `knee` tokens, then linear (compute-bound)."""
    return CostModel(CostTable(SIZES, [flat_ms + slope * max(0, s - knee) for s in SIZES]),
                     CostTable(SIZES, [draft_ms] * len(SIZES)))


def _brute(surv, n, decode_tokens, prefill, R, cost, apart, ref_rate=None):
    """From first principles: every budget B's expected tokens by an explicit allocation, the
    decode-only step's best B and rate, the two ways to run the step, and the margin (a per-step
    overhead in the prices counted once for the two forwards of one step); ref_rate, where given,
    is the rate the extra time is valued at instead of the tables' best."""
    K = surv.shape[1]
    draft = float(cost.draft_ms(R))
    best_b, best_rate = 0, -1.0
    for b in range(surv.shape[0] * K + 1):
        lens = allocate(surv, b)
        tokens = n + sum(float(surv[r, :lens[r]].sum()) for r in range(surv.shape[0]))
        rate = tokens / (draft + float(cost.verify_ms(decode_tokens + b)))
        if rate > best_rate + 1e-12:
            best_b, best_rate = b, rate
    if best_b == 0:
        return False, 0
    lens = allocate(surv, best_b)
    gain = sum(float(surv[r, :lens[r]].sum()) for r in range(surv.shape[0]))
    ref = max(best_rate, n / float(cost.verify_ms(decode_tokens))) if ref_rate is None else ref_rate
    t_plain = float(cost.verify_ms(decode_tokens + prefill))
    if apart:
        overhead = cost.overhead.value if isinstance(cost, OverheadCost) else 0.0
        t_draft = draft + float(cost.verify_ms(decode_tokens + best_b)) + float(cost.verify_ms(prefill)) - overhead
    else:
        t_draft = draft + float(cost.verify_ms(decode_tokens + best_b + prefill))
    return gain > ref * (t_draft - t_plain), best_b


def _random_case(rng):
    """Rows that draft (R), rows that sample (n <= R: some may be out of slots), query tokens
    (T >= n), each drawn on its own; a knee-shaped table, now and then with a step overhead."""
    R, K = int(rng.integers(1, 6)), int(rng.integers(1, 8))
    n = int(rng.integers(1, R + 1))
    T = n + int(rng.integers(0, 4))
    surv = survival(rng.uniform(0.05, 1.0, size=(R, K)))
    cost = _knee_cost(flat_ms=float(rng.uniform(2, 20)), knee=int(rng.choice([8, 32, 64, 256])),
                      slope=float(rng.uniform(0.01, 1.0)), draft_ms=float(rng.uniform(0.1, 8)))
    if rng.integers(3) == 0:
        cost = OverheadCost(cost, StepOverhead(float(rng.uniform(0.5, 5))))
    return surv, R, n, T, cost


def test_the_margin_decision_matches_a_brute_force():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(400):
        surv, R, n, T, cost = _random_case(rng)
        prefill = int(rng.choice([1, 17, 200, 1500, 3000]))
        apart = bool(rng.integers(2))
        ref_rate = None if rng.integers(2) else float(rng.uniform(0.01, 2.0))  # a measured decode-only rate
        want = _brute(surv, n, T, prefill, R, cost, apart, ref_rate)
        got = mixed_step_drafts(surv, n, T, prefill, R, cost, apart, ref_rate)
        assert got == want, (surv, n, T, prefill, apart, ref_rate)
        seen.add((got[0], ref_rate is None))
    assert seen == {(True, True), (False, True), (True, False), (False, False)}  # both answers, both refs


def test_with_no_prompt_tokens_in_one_forward_it_is_the_decode_only_rule():
    """Nothing to fuse (P = 0, one forward): drafting at the margin pays exactly when the best
    drafting rate beats a plain step's, the rule AdaptivePolicy applies to decode-only steps."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        surv, R, n, T, cost = _random_case(rng)
        objective = budget_objective(surv, n, T, R, cost)
        b = int(np.argmax(objective))
        rule = b > 0 and float(objective[b]) > n / float(cost.verify_ms(T))
        assert mixed_step_drafts(surv, n, T, 0, R, cost, prefill_apart=False)[0] == rule


def test_the_margin_follows_the_step_shape():
    """Four rows whose decode-only steps draft (28 slots under the knee: nearly free). In one
    forward with the chunk, a 20-token chunk leaves drafting worth it, a 1,000-token one makes
    every verified slot cost its compute: plain. With the chunk in a forward of its own (the
    graphed step), drafting also pays a second forward: plain beside either chunk at confidence
    0.7; at 0.9 it pays beside the big chunk, whose own forward costs what the fused one would."""
    cost = _knee_cost()
    surv = survival(np.full((4, 7), 0.7))
    objective = budget_objective(surv, 4, 4, 4, cost)
    assert int(np.argmax(objective)) == 28 and float(objective.max()) > 4 / float(cost.verify_ms(4))
    assert mixed_step_drafts(surv, 4, 4, 20, 4, cost, prefill_apart=False) == (True, 28)
    assert mixed_step_drafts(surv, 4, 4, 1000, 4, cost, prefill_apart=False)[0] is False
    assert mixed_step_drafts(surv, 4, 4, 20, 4, cost, prefill_apart=True)[0] is False
    assert mixed_step_drafts(surv, 4, 4, 1000, 4, cost, prefill_apart=True)[0] is False
    assert mixed_step_drafts(survival(np.full((4, 7), 0.9)), 4, 4, 1000, 4, cost, prefill_apart=True)[0] is True


def test_the_policy_uses_it_only_in_fused_mode():
    cost = _knee_cost()
    ids = ["a", "b", "c", "d"]
    limits = np.full(4, 7)
    for mode, beside_a_chunk in (("separate", True), ("fused", False)):
        p = AdaptivePolicy(cost, k=7, mixed_steps=mode)
        for r in ids:
            p.observe([r], np.full((1, 7), 0.7))
        assert p.should_draft(ids, 4, 4, limits)  # a decode-only step drafts either way
        assert p.should_draft(ids, 4, 4, limits, prefill_tokens=1000, prefill_apart=True) is beside_a_chunk
        # the eager step's one forward: base_tokens count the chunk
        assert p.should_draft(ids, 4, 1004, limits, prefill_tokens=1000) is beside_a_chunk
    with pytest.raises(ValueError, match="mixed_steps"):
        AdaptivePolicy(cost, k=7, mixed_steps="fuse")


def test_a_measured_decode_only_rate_values_the_extra_time():
    """Four rows at confidence 0.7 beside a 1,000-token chunk in a forward of its own: drafting adds
    ~0.95 tokens per ms of its priced extra time, under the tables' best decode-only rate (1.14):
    plain. Valued at the rate decode-only steps measured instead, it drafts where they made less
    (0.5 tokens per ms) and stays plain where they made more (2.0)."""
    cost = _knee_cost()
    surv = survival(np.full((4, 7), 0.7))
    terms = mixed_step_terms(surv, 4, 4, 1000, 4, cost, True)
    assert terms.budget == 28 and not terms.drafts
    assert 0.9 < terms.gain / (terms.t_draft - terms.t_plain) < terms.ref < 1.2
    assert mixed_step_drafts(surv, 4, 4, 1000, 4, cost, True, ref_rate=0.5) == (True, 28)
    assert mixed_step_drafts(surv, 4, 4, 1000, 4, cost, True, ref_rate=2.0)[0] is False
    assert mixed_step_terms(surv, 4, 4, 1000, 4, cost, True, ref_rate=0.5).ref == 0.5


def _measured_policy(per_request_per_ms=None, kind=PLAIN):
    """A fused-mode policy with measured step costs, its plain (or drafting) decode-only steps at 4
    requests measured twice at the given tokens per request per ms."""
    step_costs = MeasuredStepCosts()
    p = AdaptivePolicy(_knee_cost(), k=7, mixed_steps="fused", step_costs=step_costs)
    for r in "abcd":
        p.observe([r], np.full((1, 7), 0.7))
    if per_request_per_ms is not None:
        for _ in range(step_costs.min_samples):
            step_costs.observe(kind, 4, wall_ms=10.0, tokens=round(per_request_per_ms * 4 * 10.0))
    return p


def test_the_fused_policy_values_time_at_the_measured_rate_when_step_costs_are_measured():
    ids, limits = list("abcd"), np.full(4, 7)
    beside_a_chunk = dict(prefill_tokens=1000, prefill_apart=True)
    assert _measured_policy().measured_decode_rate(4) is None  # nothing measured yet: the tables' rate
    assert _measured_policy().should_draft(ids, 4, 4, limits, **beside_a_chunk) is False
    slow = _measured_policy(0.125)  # 0.5 tokens per ms over the 4 requests
    assert slow.measured_decode_rate(4) == pytest.approx(0.5)
    assert slow.should_draft(ids, 4, 4, limits, **beside_a_chunk) is True
    assert _measured_policy(0.5).should_draft(ids, 4, 4, limits, **beside_a_chunk) is False  # 2.0 per ms
    assert _measured_policy(0.125, DRAFT).should_draft(ids, 4, 4, limits, **beside_a_chunk) is True
    both = _measured_policy(0.125)
    for _ in range(2):  # the better kind's rate counts: drafting steps measured at 2.0 per ms
        both.step_costs.observe(DRAFT, 4, wall_ms=10.0, tokens=20)
    assert both.measured_decode_rate(4) == pytest.approx(2.0)
    assert both.should_draft(ids, 4, 4, limits, **beside_a_chunk) is False
    # without measured step costs the tables' rate decides, as before
    plain_policy = AdaptivePolicy(_knee_cost(), k=7, mixed_steps="fused")
    for r in "abcd":
        plain_policy.observe([r], np.full((1, 7), 0.7))
    assert plain_policy.measured_decode_rate(4) is None
    assert plain_policy.should_draft(ids, 4, 4, limits, **beside_a_chunk) is False


def test_steps_skipped_for_their_chunks_do_not_count_toward_probes():
    """Probes (a drafting step after a run of skips) refresh the confidences of requests the decode
    tables keep skipping; steps skipped for their prompt chunks sit between decode-only steps that
    draft, so 40 of them in a row never force one to draft, nor lengthen the probe interval."""
    p = AdaptivePolicy(_knee_cost(), k=7, probe_every=4, mixed_steps="fused")
    ids, limits = ["a", "b", "c", "d"], np.full(4, 7)
    for r in ids:
        p.observe([r], np.full((1, 7), 0.7))
    assert not any(p.should_draft(ids, 4, 4, limits, prefill_tokens=1000, prefill_apart=True) for _ in range(40))
    assert p.probe_interval == 4 and p.skipped_in_a_row == 0
    assert p.should_draft(ids, 4, 4, limits)  # and the decode-only step after them drafts


def test_the_config_key_is_checked():
    assert SpeculativeConfig.from_dict({"adaptive_verification_mixed_steps": "fused"}).adaptive_verification_mixed_steps \
        == "fused"
    assert SpeculativeConfig.from_dict({}).adaptive_verification_mixed_steps == "separate"
    with pytest.raises(ConfigError, match="adaptive_verification_mixed_steps"):
        SpeculativeConfig.from_dict({"adaptive_verification_mixed_steps": "one forward"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed_steps")
    target = make_micro_model_dir(root / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    return str(target), str(make_bigram_drafter_dir(root / "drafter", target, block_size=7))


def test_fused_engine_skips_drafting_beside_chunks_and_keeps_the_targets_outputs(pair, tmp_path):
    """The CPU engine (one forward per step) with a knee-shaped cost: in fused mode the steps that
    carry prompt chunks do not draft while decode-only steps do; in separate mode every step drafts;
    greedy outputs are the target's in both."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (int(n),), generator=g).tolist() for n in torch.randint(70, 120, (10,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=96, block_size=4)
    want = [o.outputs[0].token_ids for o in LLM(pair[0], **kw).generate(prompts, params)]
    skipped = {}
    for mode in ("separate", "fused"):
        cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 7, "enable_adaptive_verification": True,
               "cost_model_cache_dir": str(tmp_path), "adaptive_verification_mixed_steps": mode}
        llm = LLM(pair[0], speculative_config=cfg, async_scheduling=False, **kw)
        eng = llm.llm_engine
        eng.spec.policy = AdaptivePolicy(_knee_cost(), k=7, probe_every=1000, mixed_steps=mode)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want, mode
        st = eng.stats
        assert st.num_draft_tokens > 0, mode  # decode-only steps drafted
        skipped[mode] = st.num_steps_draft_skipped
    assert skipped["separate"] == 0 and skipped["fused"] > 0


def _recording(policy):
    """The policy with every should_draft call recorded: (prefill_tokens, prefill_apart, answer)."""
    calls, inner = [], policy.should_draft

    def should_draft(*a, prefill_tokens=0, prefill_apart=False):
        calls.append((prefill_tokens, prefill_apart, inner(*a, prefill_tokens=prefill_tokens, prefill_apart=prefill_apart)))
        return calls[-1][2]
    policy.should_draft = should_draft
    return calls


def _fused_llm(pair, tmp_path, async_scheduling, graphs=False, **kw):
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 7, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path), "adaptive_verification_mixed_steps": "fused"}
    llm = LLM(pair[0], speculative_config=cfg, async_scheduling=async_scheduling, **kw)
    eng = llm.llm_engine
    if graphs:  # the pipelined graphed path, its graphs replayed eagerly on the CPU (test_pipelined.py)
        use_eager_spec_graphs(llm, [1, 2, 4])
    eng.spec.policy = AdaptivePolicy(_knee_cost(), k=7, probe_every=1000, mixed_steps="fused")
    return llm, _recording(eng.spec.policy)


def _workload(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 300, (int(L),), generator=g).tolist() for L in torch.randint(20, 120, (n,), generator=g)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 7), ignore_eos=True,
                             stop_token_ids=[7, 11, 19] if i % 3 else [], logprobs=2 if i % 4 == 1 else None)
              for i in range(n)]
    return prompts, params


def _same_outputs(pair, llm, prompts, params, **kw):
    want = [o.outputs[0] for o in LLM(pair[0], **kw).generate(prompts, params)]
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [(g.token_ids, g.finish_reason) for g in got] == [(w.token_ids, w.finish_reason) for w in want]
    eng = llm.llm_engine
    st = eng.stats
    # every path counts the kept tokens only (a discarded row goes to num_discarded_rows)
    assert st.num_generated_tokens == st.num_accepted_tokens + st.num_bonus_tokens + st.num_sampled_without_draft
    assert eng.kv_blocks_free() == eng.kv_blocks_total() and not eng.has_unfinished_requests()


def test_async_fused_skips_only_the_steps_with_chunks(pair, tmp_path):
    """Adaptive speculation under async scheduling without pipelined graphs: a step the fused
    policy skips for its prompt chunks runs as the plain async step, and the next step asks again
    (a skip for the decode tables would run plain steps until a probe): every plain step is one
    the policy skipped, every skip had chunks, and decode-only steps drafted."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=96, block_size=4)
    llm, calls = _fused_llm(pair, tmp_path, True, **kw)
    prompts, params = _workload()
    _same_outputs(pair, llm, prompts, params, **kw)
    st = llm.llm_engine.stats
    skips = [c for c in calls if c[2] is False]
    assert skips and all(p > 0 for p, _, _ in skips)
    assert st.num_steps_draft_skipped == len(skips)
    assert any(p == 0 and answer for p, _, answer in calls)


@pytest.mark.parametrize("kw", [dict(max_num_seqs=6, max_num_batched_tokens=64, block_size=8),
                                dict(max_num_seqs=6, max_num_batched_tokens=64, block_size=8, num_kv_blocks=45)],
                         ids=["roomy", "preempting"])
def test_pipelined_fused_steps_run_as_one_forward(pair, tmp_path, kw):
    """The pipelined graphed engine (graphs for up to 4 rows, 6 requests: decode-only steps with rows
    past the graphs occur): steps with chunks it does not draft read the speculative step in flight
    back and run as one forward, the plain async step, and a chunk step after one of those is
    launched behind it before it is read back; the policy prices chunks only where a step has some;
    outputs equal the plain engine's, also when requests are preempted."""
    llm, calls = _fused_llm(pair, tmp_path, True, graphs=True, **kw)
    eng = llm.llm_engine
    assert eng._pipelines_spec()
    behind = []  # per plain launch: whether another plain step was in flight
    launch = eng._launch_plain_step

    def spy(scheduled):
        behind.append(eng._in_flight is not None)
        return launch(scheduled)
    eng._launch_plain_step = spy
    prompts, params = _workload(14, seed=2)
    _same_outputs(pair, llm, prompts, params, **kw)
    st = eng.stats
    assert st.num_mixed_steps_fused > 0 and st.num_pipelined_steps > 0 and st.num_draft_tokens > 0
    assert all(p > 0 for p, apart, _ in calls if apart)  # decide_mixed asks only for steps with chunks
    assert True in behind and False in behind, behind  # chunk steps launched behind a plain one, and after a drain
    if "num_kv_blocks" in kw:
        assert st.num_preemptions > 0, "the KV budget was meant to force preemption"


def test_measured_fused_pipelined_steps_time_only_whole_decode_only_steps(pair, tmp_path):
    """The fused mode with measured step costs and the graphs runs pipelined (until H100 run 62 it
    ran unpipelined: decide_drafting). Only whole decode-only steps are timed for the step costs: a
    pipelined step whose prompt chunks run beside its graphed rows, or a synchronous step split in
    two forwards (rows past the graphs beside the graphed ones), holds another forward in its wall,
    and a split step is not priced as its part's shape either (the overhead, the cost check). A
    step with chunks asks the policy with the decoding rows' tokens, the chunks apart."""
    kw = dict(max_num_seqs=6, max_num_batched_tokens=64, block_size=8)
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 7, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path), "adaptive_verification_mixed_steps": "fused",
           "adaptive_verification_step_costs": "measured"}
    llm = LLM(pair[0], speculative_config=cfg, async_scheduling=True, **kw)
    eng, spec = llm.llm_engine, llm.llm_engine.spec
    use_eager_spec_graphs(llm, [1, 2, 4])
    assert eng._pipelines_spec()
    policy = spec.policy = AdaptivePolicy(_knee_cost(), k=7, probe_every=1000, mixed_steps="fused",
                                          step_costs=MeasuredStepCosts())
    asked, inner = [], policy.should_draft

    def should_draft(ids, n_sampling, base_tokens, limits, prefill_tokens=0, prefill_apart=False):
        asked.append((n_sampling, base_tokens, prefill_tokens, prefill_apart))
        return inner(ids, n_sampling, base_tokens, limits, prefill_tokens=prefill_tokens, prefill_apart=prefill_apart)
    policy.should_draft = should_draft
    launched, observed = [], []  # per pipelined launch: (other rows beside the graphed ones, cost_kind)
    launch_pipelined, observe = spec.launch_pipelined, policy.step_costs.observe

    def spied_launch(scheduled, prev, serial, **kw):
        step = launch_pipelined(scheduled, prev, serial, **kw)
        launched.append((len(step.graphed) < len(step.scheduled), step.cost_kind))
        return step
    spec.launch_pipelined = spied_launch
    policy.step_costs.observe = lambda *a: (observed.append(a), observe(*a))[1]
    parts, split_planned = [], []
    launch, run = spec._launch, spec._run

    def counted_launch(*a, **k):
        parts.append(1)
        return launch(*a, **k)

    def watched_run(scheduled, report):
        parts.clear()
        run(scheduled, report)
        if len(parts) == 2:  # split: whatever it planned must be neither timed nor priced
            split_planned.append((policy._open, policy._planned, policy._costed))
    spec._launch, spec._run = counted_launch, watched_run
    prompts, params = _workload(14, seed=2)
    _same_outputs(pair, llm, prompts, params, **kw)
    beside = [a for a in asked if a[3] and a[2] > 0]
    assert beside and all(base_tokens == n_sampling for n_sampling, base_tokens, _, _ in beside)
    assert any(others for others, _ in launched) and all(kind is None for others, kind in launched if others)
    timed = [kind for others, kind in launched if kind is not None]
    assert observed and len(observed) <= len(timed)  # (a step launched after a drain is not timed)
    assert split_planned and all(planned == (None, None, None) for planned in split_planned)
    assert eng.stats.num_pipelined_steps > 0 and eng.stats.num_draft_tokens > 0


def test_abort_with_a_fused_plain_step_in_flight(pair, tmp_path):
    """A request aborted while a plain chunk step of the fused mode is in flight (its token behind a
    placeholder): it ends with "abort", its row's token is thrown away, the others' outputs are the
    plain engine's, and every KV block comes back."""
    kw = dict(max_num_seqs=6, max_num_batched_tokens=64, block_size=8)
    llm, _ = _fused_llm(pair, tmp_path, True, graphs=True, **kw)
    eng = llm.llm_engine
    prompts, params = _workload(14, seed=2)
    want = [o.outputs[0] for o in LLM(pair[0], **kw).generate(prompts, params)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    done, victim = {}, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        plain = eng._in_flight
        if victim is None and plain is not None:
            alive = [seq for seq in plain.seqs if not seq.finished and seq.num_output_tokens > 1]
            if alive:
                victim = alive[0].request_id
                eng.abort_request(victim)
    assert victim is not None, "no plain step was in flight with a decoding row"
    assert done[victim].outputs[0].finish_reason == "abort"
    for i, w in enumerate(want):
        if str(i) != victim:
            assert (done[str(i)].outputs[0].token_ids, done[str(i)].outputs[0].finish_reason) == (w.token_ids, w.finish_reason)
    assert eng.kv_blocks_free() == eng.kv_blocks_total() and eng.stats.num_discarded_rows > 0


def test_a_request_admitted_behind_a_plain_step_keeps_its_whole_prompt(pair, tmp_path):
    """enable_chunked_prefill=False with a policy that drafts beside every prompt chunk: a step
    scheduled behind a plain step in flight that admits a request runs as scheduled (plain), not
    scheduled again with draft slots, which ran only part of the newcomer's prompt (the rows past
    the graphs' 4 take 1 + k slots each from the budget) or preempted it before it ran."""
    kw = dict(max_num_seqs=9, max_num_batched_tokens=96, max_model_len=96, block_size=8, enable_chunked_prefill=False)
    llm, _ = _fused_llm(pair, tmp_path, True, graphs=True, **kw)
    eng = llm.llm_engine
    first_chunks = []  # (tokens run, prompt length) of every prompt's first chunk that ran

    def watch(scheduled):
        first_chunks.extend((s.num_tokens, len(s.seq.prompt_token_ids)) for s in scheduled
                            if s.seq.num_output_tokens == 0 and s.seq.num_computed_tokens == 0)
    for owner, name in ((eng, "_launch_plain_step"), (eng.spec, "launch_pipelined"), (eng.spec, "step")):
        inner = getattr(owner, name)
        setattr(owner, name, lambda scheduled, *a, _inner=inner, **kw: (watch(scheduled), _inner(scheduled, *a, **kw))[1])
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(1, 300, (n,), generator=g).tolist()
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = {f"d{i}": prompt(8) for i in range(7)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, sp)
    for _ in range(4):
        eng.step()
    prompts["y"] = prompt(20)
    eng.add_request("y", prompts["y"], sp)
    for _ in range(20):
        if eng._in_flight is not None:
            break
        eng.step()
    assert eng._in_flight is not None, "no plain step in flight"
    policy, asked = eng.spec.policy, eng.spec.policy.should_draft

    def drafts_beside_chunks(*a, prefill_tokens=0, prefill_apart=False):  # any answer is lossless
        answer = asked(*a, prefill_tokens=prefill_tokens, prefill_apart=prefill_apart)
        if prefill_tokens > 0:
            policy._budget_now = None
            return True
        return answer
    policy.should_draft = drafts_beside_chunks
    prompts["x"] = prompt(80)
    params = {rid: sp for rid in prompts} | {"x": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)}
    eng.add_request("x", prompts["x"], params["x"])
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    ids = sorted(prompts)
    want = LLM(pair[0], **kw).generate([prompts[i] for i in ids], [params[i] for i in ids])
    assert [got[i] for i in ids] == [w.outputs[0].token_ids for w in want]
    assert (80, 80) in first_chunks and all(n == length for n, length in first_chunks), first_chunks
    assert eng.scheduler.num_preemptions == 0

