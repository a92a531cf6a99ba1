"""Pipelined speculative steps (spec_decode/pipelined.py), on CPU through the graphed step's eager
capture: step t + 1 is launched before step t is read back, the carried requests take their last
token and position on the device. Outputs must equal the synchronous engine's token for token
(greedy; seeded sampling with fixed k, whose verify lengths do not depend on timing), through stop
tokens that end requests with a step in flight, KV pressure that would preempt, rows the graphs do
not serve, and aborts."""
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.sampling_params import RequestOutputKind
from adaspec.engine.async_step import PENDING
from adaspec.engine.scheduler import DrainFirst, Scheduler
from adaspec.engine.block_manager import BlockManager
from adaspec.engine.sequence import Sequence
from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir, pin_cost_tables, use_eager_spec_graphs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelined")
    target = make_micro_model_dir(root / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    drafter = make_bigram_drafter_dir(root / "drafter", target, block_size=7)
    return str(target), str(drafter), str(root)


def _prompts(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (L,), generator=g).tolist() for L in torch.randint(2, 30, (n,), generator=g).tolist()]


def _llm(pair, k=3, adaptive=False, pipelined=True, spec_extra=None, **kw):
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": k,
           "enable_adaptive_verification": adaptive, "cost_model_cache_dir": pair[2], **(spec_extra or {})}
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=6, max_num_batched_tokens=64, block_size=8,
              async_scheduling=pipelined, **kw)
    if adaptive:
        pin_cost_tables(llm)  # its drafts must run whatever this machine's load makes of the tables
    use_eager_spec_graphs(llm, [1, 2, 4, 6])
    return llm


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(pair):
    return [o.outputs[0].token_ids for o in LLM(pair[0]).generate(_prompts(), GREEDY)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _check_books(eng):
    st = eng.stats
    assert st.num_generated_tokens == st.num_accepted_tokens + st.num_bonus_tokens + st.num_sampled_without_draft
    assert eng.kv_blocks_free() == eng.kv_blocks_total()
    assert eng._spec_in_flight is None and not eng.has_unfinished_requests()


@pytest.mark.parametrize("k, adaptive", [(3, False), (7, False), (7, True)])
def test_pipelined_greedy_equals_plain(pair, plain_greedy, k, adaptive):
    llm = _llm(pair, k, adaptive)
    g = llm.llm_engine.spec.graphed
    order = []
    launch, read_back = g.launch, g.read_back
    g.launch = lambda *a, **kw: (order.append("launch"), launch(*a, **kw))[1]
    g.read_back = lambda: (order.append("read"), read_back())[1]
    spec = llm.llm_engine.spec
    launches = []  # per launch: ids of its graphed requests, ids of those whose prefill it finished
    inner = spec.launch_pipelined

    def launch_and_note(*a, **kw):
        step = inner(*a, **kw)
        launches.append(({id(step.scheduled[i].seq) for i in step.graphed},
                         [id(step.scheduled[i].seq) for i in step.prefill_rows]))
        return step

    spec.launch_pipelined = launch_and_note
    assert _tokens(llm.generate(_prompts(), GREEDY)) == plain_greedy
    st = llm.llm_engine.stats
    assert st.num_pipelined_steps > 10 and st.num_pipeline_drains == 0
    # a request whose prefill sampled its first token decodes in the very next step (the token
    # taken on the device), and every request that keeps decoding is carried
    took_first = 0
    for (_, first), (nxt, _) in zip(launches, launches[1:]):
        assert set(first) <= nxt
        took_first += len(first)
    assert took_first >= 5
    # most read backs come after the next step's launch: two steps launched and unread
    outstanding, ahead = 0, 0
    for ev in order:
        ahead += ev == "read" and outstanding == 2
        outstanding += 1 if ev == "launch" else -1
    assert ahead >= st.num_graphed_steps // 2, order
    _check_books(llm.llm_engine)


def test_pipelined_seeded_sampling_equals_synchronous(pair):
    """Fixed k verifies the same drafts whenever a step runs, and the randoms are keyed by position:
    a pipelined run samples the very tokens of a synchronous one (greedy rows mixed in)."""
    params = [SamplingParams(temperature=0.7 + 0.1 * (i % 3), max_tokens=24, ignore_eos=True, seed=10 + i)
              for i in range(10)]
    params[4] = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    sync_llm = _llm(pair, 3, pipelined=False)
    sync = _tokens(sync_llm.generate(_prompts(), params))
    llm = _llm(pair, 3)
    assert _tokens(llm.generate(_prompts(), params)) == sync
    assert llm.llm_engine.stats.num_pipelined_steps > 10
    _check_books(llm.llm_engine)
    # the same drafts, verified and accepted (near max_tokens the device caps a carried row's slots:
    # counted as the device ran them, as a synchronous step schedules them)
    a, b = sync_llm.llm_engine.stats, llm.llm_engine.stats
    keys = ("num_drafts", "num_draft_tokens", "num_verified_tokens", "num_accepted_tokens", "num_capped_draft_slots",
            "num_sampled_without_draft")
    assert [getattr(b, x) for x in keys] == [getattr(a, x) for x in keys]


def test_stop_tokens_end_requests_with_a_step_in_flight(pair):
    """Requests ending on a stop token in step t were launched in step t + 1: those rows are thrown
    away and the outputs are the synchronous engine's."""
    plain = _tokens(LLM(pair[0]).generate(_prompts(), GREEDY))
    counts = {}
    for toks in plain:
        for t in toks[2:]:
            counts[t] = counts.get(t, 0) + 1
    stop = sorted(counts, key=counts.get)[-3:]  # frequent tokens: most requests stop early
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop)
    sync = _tokens(_llm(pair, 3, pipelined=False).generate(_prompts(), params))
    assert sum(len(t) < 20 for t in sync) >= 3, "the stop tokens were meant to end several requests"
    llm = _llm(pair, 3)
    assert _tokens(llm.generate(_prompts(), params)) == sync
    st = llm.llm_engine.stats
    assert st.num_discarded_rows > 0 and st.num_pipelined_steps > 5
    _check_books(llm.llm_engine)


def test_seeded_sampling_with_stops_extras_and_arrivals_equals_synchronous(pair):
    """The GPU test's case on the CPU (tests/engine/test_cuda_graphs_gpu.py, the busy-GPU pipelined
    test, fixed k): seeded T = 1, stop tokens that end requests with a step in flight, rows with
    logprobs and with top-p, and arrivals (more requests than the pipelined engine runs at once, so
    prefill rows ride along): token for token the synchronous engine's, which runs them all at once."""
    prompts = _prompts(13, seed=5)

    def extra(i):
        return dict(logprobs=1) if i % 5 == 1 else dict(top_p=0.9) if i % 5 == 2 else {}

    params = [SamplingParams(temperature=1.0, max_tokens=8 + 5 * (i % 7), seed=i, ignore_eos=True,
                             stop_token_ids=list(range(10 + i, 300, 37)), **extra(i)) for i in range(13)]
    sync_llm = _llm(pair, 5, pipelined=False)
    sync = _tokens(sync_llm.generate(prompts, params))
    assert sum(len(t) < p.max_tokens for t, p in zip(sync, params)) >= 3, "stop tokens were meant to end some"
    llm = _llm(pair, 5)
    llm.llm_engine.scheduler.max_num_seqs = 4  # arrivals while others decode
    assert _tokens(llm.generate(prompts, params)) == sync
    eng, a, b = llm.llm_engine, sync_llm.llm_engine.stats, llm.llm_engine.stats
    assert b.num_pipelined_steps > 10 and b.num_discarded_rows > 0
    # the same drafts verified and accepted per request, whatever ran beside them (the rows of a
    # request that ended with a step in flight are not counted); a stop token inside an accepted
    # block leaves drafts counted as accepted that were never emitted, in both engines alike
    keys = ("num_drafts", "num_draft_tokens", "num_verified_tokens", "num_accepted_tokens", "num_capped_draft_slots",
            "num_bonus_tokens", "num_sampled_without_draft", "num_generated_tokens")
    assert [getattr(b, x) for x in keys] == [getattr(a, x) for x in keys]
    assert eng.kv_blocks_free() == eng.kv_blocks_total()
    assert eng._spec_in_flight is None and not eng.has_unfinished_requests()


def test_kv_pressure_drains_instead_of_preempting_in_flight(pair, plain_greedy):
    """Too few KV blocks for every request's worst case: the engine reads the step in flight back
    and schedules again (preempting when it must), never preempting a request with a step in flight."""
    llm = _llm(pair, 3, num_kv_blocks=12, max_model_len=64)
    assert _tokens(llm.generate(_prompts(), GREEDY)) == plain_greedy
    st = llm.llm_engine.stats
    assert st.num_pipeline_drains > 0 and st.num_pipelined_steps > 5
    _check_books(llm.llm_engine)


def test_rows_with_logprobs_or_filters_are_pipelined(pair):
    """Logprobs and top-k / top-p rows stay in the graphs (graphed_extras.py), so their steps are
    pipelined like the others, and emit what the synchronous engine emits."""
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, max_tokens=12, ignore_eos=True, seed=i,
                             logprobs=2 if i in (2, 3) else None, top_k=4 if i == 4 else 0) for i in range(6)]
    sync = _llm(pair, 3, pipelined=False).generate(_prompts(6), params)
    llm = _llm(pair, 3)
    outs = llm.generate(_prompts(6), params)
    assert _tokens(outs) == _tokens(sync)
    for i in (2, 3):
        assert len(outs[i].outputs[0].logprobs) == 12
        for a, b in zip(outs[i].outputs[0].logprobs, sync[i].outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    st = llm.llm_engine.stats
    assert st.num_pipeline_drains == 0 and st.num_pipelined_steps > 5
    _check_books(llm.llm_engine)


def test_abort_with_a_step_in_flight(pair, plain_greedy):
    llm = _llm(pair, 3)
    eng = llm.llm_engine
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, GREEDY)
    done, aborted = {}, False
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if not aborted and eng._spec_in_flight is not None and eng._spec_in_flight.graphed:
            victim = eng._spec_in_flight.scheduled[eng._spec_in_flight.graphed[0]].seq.request_id
            eng.abort_request(victim)
            aborted = True
    assert aborted and done[victim].outputs[0].finish_reason == "abort"
    for i, toks in enumerate(plain_greedy):
        if str(i) != victim:
            assert done[str(i)].outputs[0].token_ids == toks
    _check_books(eng)


# -- the scheduler's side -------------------------------------------------------------------------
def _running(bm, n_prompt, n_out, max_tokens, in_flight):
    seq = Sequence("r", None, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))
    seq.token_ids += [5] * n_out
    seq.num_computed_tokens = len(seq.token_ids) - 1
    bm.grow(seq, len(seq.token_ids))
    seq.in_flight_max = in_flight
    return seq


def test_scheduler_counts_the_step_in_flight():
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, 8, 256, 100, num_spec_tokens=3, draft_lookahead=3)
    seq = _running(bm, 10, 2, max_tokens=8, in_flight=4)  # its step in flight may emit 1 to 4 tokens
    sch.running.append(seq)
    (s,) = sch.schedule(pipelined=True)
    # one certain token -> 3 outputs, 5 remaining; KV as if all 4 came: last token at 11 + 4 = 15
    assert (s.num_tokens, s.spec_slots, s.remaining) == (1, 3, 5)
    assert len(seq.block_table) == -(-(15 + 1 + 3) // 4)
    seq.in_flight_max = 4
    seq.token_ids += [5] * 5  # 7 outputs: the step in flight surely makes the 8th, the last
    seq.num_computed_tokens = len(seq.token_ids) - 1
    assert sch.schedule(pipelined=True) == []
    # a prefill's sampled first token on its way: a placeholder, counted exactly
    seq.in_flight_max = 0
    seq.token_ids = seq.token_ids[:10] + [PENDING]
    seq.num_computed_tokens = 10
    (s,) = sch.schedule(pipelined=True)
    assert (s.num_tokens, s.spec_slots, s.remaining, s.samples) == (1, 3, 0, True)


def test_scheduler_never_grows_past_the_request_end():
    """The host's bound of a step in flight is the uncapped draft count; the device caps it at the
    tokens left. Two steps in flight near max_model_len must not grow a block table past
    max_model_len + the lookahead (the graphs' captured width)."""
    M, k, bs = 64, 7, 8
    bm = BlockManager(100, bs)
    sch = Scheduler(bm, 8, 256, M, num_spec_tokens=k, draft_lookahead=k)
    seq = _running(bm, 40, 15, max_tokens=None, in_flight=1 + 7)  # 55 tokens, step t-1 in flight
    sch.running.append(seq)
    (s,) = sch.schedule(pipelined=True)  # step t: 7 slots on the host
    assert s.spec_slots == 7
    seq.in_flight_max = 1 + s.spec_slots
    seq.token_ids += [5] * 6  # step t-1 is read back: 5 accepted, so the device gave step t 2 slots
    seq.num_computed_tokens += 6
    (z,) = sch.schedule(pipelined=True)  # step t + 1
    assert len(seq.block_table) <= -(-(M + k) // bs)
    assert z.remaining <= M - len(seq.token_ids) - 1


def test_requests_running_to_max_model_len(pair):
    """k = 7 up to the context limit (run before the scheduler's bound was clamped, max_model_len 65
    raised "a block table of 10 blocks exceeds the captured width 9")."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    for max_len in (63, 65, 66):
        sync = _tokens(_llm(pair, 7, pipelined=False, max_model_len=max_len).generate(_prompts(), params))
        llm = _llm(pair, 7, max_model_len=max_len)
        got = llm.generate(_prompts(), params)
        assert _tokens(got) == sync
        assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == max_len for o in got)
        _check_books(llm.llm_engine)


def test_abort_while_the_first_token_is_on_its_way(pair):
    """A final-only request aborted right after its prefill sampled (a placeholder on the host): its
    text is made without the placeholder, the step's row is thrown away, the books balance."""
    llm = _llm(pair, 3)
    eng = llm.llm_engine
    final = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(_prompts(4)):
        eng.add_request(str(i), p, final)
    done = {}
    while not (eng._spec_in_flight is not None and eng._spec_in_flight.prefill is not None):
        done.update({o.request_id: o for o in eng.step() if o.finished})
    victim = eng._spec_in_flight.prefill.seqs[0]
    assert victim.token_ids[-1] == PENDING
    eng.abort_request(victim.request_id)
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    out = done[victim.request_id].outputs[0]
    assert out.finish_reason == "abort" and PENDING not in out.token_ids
    assert eng.stats.num_discarded_rows >= 1
    _check_books(eng)


def test_release_cuda_graphs_with_a_step_in_flight(pair, plain_greedy):
    llm = _llm(pair, 3)
    eng = llm.llm_engine
    for i, p in enumerate(_prompts()):
        eng.add_request(str(i), p, GREEDY)
    done = {}
    while eng._spec_in_flight is None or not eng._spec_in_flight.graphed:
        done.update({o.request_id: o for o in eng.step() if o.finished})
    eng.release_cuda_graphs()  # (eager-captured here: nothing to free but the references)
    assert eng.spec.graphed is None and eng._spec_in_flight is None  # read back first: its outputs
    assert eng._held_outputs  # come with the next step()
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [done[str(i)].outputs[0].token_ids for i in range(len(plain_greedy))] == plain_greedy
    _check_books(eng)


def test_fixed_k_pipelines_whatever_the_step_costs_setting(pair):
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3, "cost_model_cache_dir": pair[2],
           "adaptive_verification_step_costs": "measured"}
    llm = _llm(pair, 3)
    llm.llm_engine.spec.cfg.adaptive_verification_step_costs = cfg["adaptive_verification_step_costs"]
    assert llm.llm_engine._pipelines_spec()  # the setting is the adaptive policy's; fixed k ignores it


def test_measured_step_costs_charge_each_pipelined_step_its_own_gpu_time(pair, plain_greedy, monkeypatch):
    """With measured step costs the adaptive engine runs pipelined, and a decode-only step's wall
    is the time from the previous step's results to its own: launched behind that step, the GPU ran
    it right after. A fake clock plays a GPU-bound pipeline: a launched step runs on the "GPU"
    once the step before it is done, for 3 ms if it drafts and 1 ms if not, and its prompt chunks
    2 ms more; a read back (or the chunks' wait) moves the clock to that work's end; the host's
    bookkeeping on a drafted step's results (the policy's confidences) takes 0.5 ms, which the next
    wait absorbs. Every measured step must be
    charged its own kind's time. Launch to launch would charge it the step before's (the loop
    launches a step, then waits for the one before), and a stamp taken after the bookkeeping the
    bookkeeping's difference between kinds: both wrong wherever the kinds change, at every plain
    probe."""
    from adaspec.engine import llm_engine
    from adaspec.spec_decode.step_costs import DRAFT, PLAIN

    llm = _llm(pair, 7, adaptive=True, spec_extra={"adaptive_verification_step_costs": "measured"})
    eng = llm.llm_engine
    assert eng._pipelines_spec() and eng.spec.policy.step_costs is not None
    now, gpu_free, done = [0.0], [0.0], []  # the clock; when the GPU is free; each launched step's end
    monkeypatch.setattr(llm_engine, "step_clock", lambda: now[0])
    g, policy = eng.spec.graphed, eng.spec.policy
    launch, read_back, confidences = g.launch, g.read_back, policy.observe

    def timed_launch(*a, **kw):  # GraphedSpecStep.launch(key, tokens, positions, slots, seeds, temps, tables, drafting, ...)
        gpu_free[0] = max(now[0], gpu_free[0]) + (3e-3 if a[7] else 1e-3)
        done.append(gpu_free[0])
        return launch(*a, **kw)

    def timed_read_back():
        now[0] = max(now[0], done.pop(0))
        return read_back()

    def timed_confidences(*a, **kw):
        now[0] += 0.5e-3
        return confidences(*a, **kw)

    def timed_chunks(*a, **kw):
        gpu_free[0] = max(now[0], gpu_free[0]) + 2e-3
        pending, rows = launch_prefill(*a, **kw)
        if pending is not None:
            end, wait = gpu_free[0], pending.wait
            pending.wait = lambda: (now.__setitem__(0, max(now[0], end)), wait())[1]
        return pending, rows
    launch_prefill = eng.spec._launch_prefill
    g.launch, g.read_back, policy.observe = timed_launch, timed_read_back, timed_confidences
    eng.spec._launch_prefill = timed_chunks
    observed, launched = [], []  # launched: per pipelined step, (prompt chunks beside its graphed rows, cost_kind)
    observe, launch_pipelined = eng.spec.policy.step_costs.observe, eng.spec.launch_pipelined
    eng.spec.policy.step_costs.observe = lambda *a: (observed.append(a), observe(*a))[1]

    def spied_launch(*a, **kw):
        step = launch_pipelined(*a, **kw)
        launched.append((len(step.graphed) < len(step.scheduled), step.cost_kind))
        return step
    eng.spec.launch_pipelined = spied_launch
    assert _tokens(llm.generate(_prompts(), GREEDY)) == plain_greedy
    assert {kind for kind, *_ in observed} == {DRAFT, PLAIN}, observed
    # a step whose chunks ran beside its graphed rows (their forward in its wall) is never timed
    assert any(beside for beside, _ in launched) and all(kind is None for beside, kind in launched if beside)
    assert all(wall == pytest.approx(3.0 if kind == DRAFT else 1.0) for kind, _, wall, _ in observed), observed
    assert eng.stats.num_pipelined_steps > 0
    _check_books(eng)


def test_only_a_step_launched_behind_another_is_timed(pair):
    """A step launched after the one before it was read back (a drain, a synchronous step, an idle
    engine) left the GPU idle meanwhile: the time since the last results holds the host's work,
    so it is not a step cost. Neither is a step with no kind to time, nor the first results, nor
    a step some of whose GPU work was never waited for (prompt chunks that sample nothing: its
    read back time is None), nor the step after that one."""
    from types import SimpleNamespace

    from adaspec.spec_decode.step_costs import DRAFT

    eng = _llm(pair, 7, adaptive=True, spec_extra={"adaptive_verification_step_costs": "measured"}).llm_engine
    observed = []
    eng.spec.policy.step_costs.observe = lambda *a: observed.append(a)
    results = [([1, 2, 3], None), ([4], None)]
    eng._spec_results_at = None

    def finished(at, cost_kind=(DRAFT, 2), behind=True, rows=results):
        eng._spec_read_back_at = at  # as _finish_spec leaves it: stamped at the read back, or None
        eng._time_spec_step(SimpleNamespace(cost_kind=cost_kind, behind=behind), rows)

    finished(5.000)  # no results before it
    finished(5.002, behind=False)  # launched after a drain
    finished(5.004, cost_kind=None, rows=None)  # chunks beside its graphed rows: not timed
    assert observed == [] and eng._spec_results_at == 5.004  # but each one's results time the next
    finished(5.007)
    assert observed == [(DRAFT, 2, pytest.approx(3.0), 4)]
    finished(None, cost_kind=None, rows=None)  # chunks that sampled nothing: never waited for
    finished(5.012)  # so the next step's wall is unknown too
    assert len(observed) == 1 and eng._spec_results_at == 5.012
    finished(5.014)
    assert observed[-1] == (DRAFT, 2, pytest.approx(2.0), 4)


def test_a_step_whose_chunks_were_never_waited_for_times_neither_itself_nor_the_next(pair, monkeypatch):
    """A pipelined step whose prompt chunks sample nothing (mid-prompt, or a recomputation after a
    preemption, which stops a token short) has no wait that covers its chunks' forward: its read
    back can come before that forward ends, which the next step's wall would then hold."""
    from types import SimpleNamespace

    from adaspec.engine import llm_engine

    eng = _llm(pair, 7, adaptive=True, spec_extra={"adaptive_verification_step_costs": "measured"}).llm_engine
    monkeypatch.setattr(llm_engine, "step_clock", lambda: 7.0)

    def step(num_rows):  # graphed row 0 (its request ended: nothing to hand over), chunk rows after it
        return SimpleNamespace(finish_graphed=lambda: (eng._note_spec_read_back(), [([], None)])[1], prefill=None,
                               graphed=[0], scheduled=[SimpleNamespace(seq=None)] * num_rows, cost_kind=None,
                               behind=True)
    eng._finish_spec(step(1))
    assert eng._spec_results_at == 7.0  # graphed rows only: its read back is its end
    eng._finish_spec(step(2))
    assert eng._spec_results_at is None  # a chunk row beside, sampling nothing: its end is unknown


def test_scheduler_raises_drain_first_instead_of_preempting():
    bm = BlockManager(6, 4)
    sch = Scheduler(bm, 8, 256, 100, num_spec_tokens=3, draft_lookahead=3)
    a = _running(bm, 7, 1, max_tokens=50, in_flight=4)
    b = _running(bm, 7, 1, max_tokens=50, in_flight=4)
    sch.running += [a, b]
    with pytest.raises(DrainFirst):
        sch.schedule(pipelined=True)
    a.in_flight_max = b.in_flight_max = 0
    sch.schedule()  # without a step in flight it preempts as before
    assert sch.num_preemptions >= 1


def test_the_startup_warm_up_leaves_no_step_in_flight(pair, plain_greedy):
    """engine/warm_up.py on a pipelined adaptive engine: its phases pipeline their steps, nothing is
    in flight when the counters are reset, and the engine then serves exactly as before."""
    from adaspec.engine.warm_up import warm_up_serving

    llm = _llm(pair, k=7, adaptive=True)
    eng = llm.llm_engine
    launches = []
    inner = eng.spec.launch_pipelined
    eng.spec.launch_pipelined = lambda *a, **kw: launches.append(1) or inner(*a, **kw)
    warm_up_serving(eng)
    assert launches  # the warm-up pipelined its steps
    assert eng._spec_in_flight is None and eng.stats.num_steps == 0 and eng.stats.num_discarded_rows == 0
    assert _tokens(llm.generate(_prompts(), GREEDY)) == plain_greedy
    _check_books(eng)
