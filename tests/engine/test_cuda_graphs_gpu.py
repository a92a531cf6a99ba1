"""CUDA graphs on the GPU: replays give the same greedy tokens as the eager engine (decode, and
the speculative step's propose + verify graphs with mixed draft lengths, at batch sizes that
pad), the plain decode step's seeded samples drawn in its sampling graphs and the eager
speculative step's are the eager engines' except at near-ties (float32 rounding of a padded batch
can flip a draw whose uniform sits within ~1e-7 of a CDF boundary: spec_decode/lockstep.py), and one decode or speculative step makes exactly one device-to-host
sync (its results read back; under async scheduling, the wait for the previous step's tokens).
The plain graphed engine runs with async scheduling (its default on CUDA) and is compared with
the eager engine without it."""

import sys
from pathlib import Path

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.spec_decode.lockstep import NEAR_TIE, draw_margin_after, first_draw_margin, run_lockstep
from adaspec.testing import device_sync_sites, no_eager_decodes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _prompts(n, vocab=8000):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, vocab, (int(L),), generator=g).tolist() for L in torch.randint(5, 60, (n,), generator=g)]


def _llm(eager: bool, spec: bool | str, dtype: str = "float32", tmp=None, async_scheduling=None):
    # float32: padding changes the matmuls' batch size, and in bf16 that alone can flip a greedy
    # near-tie; in float32 the graph and the eager step must agree token for token
    cfg = None
    if spec:
        cfg = {"method": "dspark", "num_speculative_tokens": 5,
               "enable_adaptive_verification": spec in ("adaptive", "measured")}
        if spec == "measured":  # pipelined since b591e30, timing its steps from their read backs
            cfg["adaptive_verification_step_costs"] = "measured"
        if tmp is not None:
            cfg["cost_model_cache_dir"] = str(tmp)
    return LLM("tiny", speculative_config=cfg, enforce_eager=eager, max_num_seqs=24, device="cuda", dtype=dtype,
               async_scheduling=async_scheduling)


def _divergence(got: list[list[int]], want: list[list[int]], params) -> str:
    """Where two runs' tokens part, for the failure message: how many requests differ and, for the
    first, its parameters and the index of its first differing token (a near-tie flip shows as one
    request diverging mid-way; a bookkeeping error as many, often from their first tokens)."""
    rows = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if not rows:
        return "equal"
    i = rows[0]
    j = next((n for n, (a, b) in enumerate(zip(got[i], want[i])) if a != b), min(len(got[i]), len(want[i])))
    return (f"{len(rows)} of {len(want)} requests differ {rows}; request {i} ({params[i]}) first at token {j} "
            f"of {len(want[i])}: got {got[i][max(0, j - 2):j + 3]}, want {want[i][max(0, j - 2):j + 3]}")


def _graph_steps(llm) -> int:
    """Steps that replayed a graph: the speculative step's own, plus (adaptive speculation's plain
    steps, and any engine's plain steps) the runner's decode and mixed graphs."""
    eng = llm.llm_engine
    runner = eng.runner.num_graph_steps + eng.runner.num_mixed_graph_steps
    if eng.spec is not None:
        return eng.stats.num_graphed_steps + (runner if eng.spec.cfg.enable_adaptive_verification else 0)
    return eng.runner.num_graph_steps


@pytest.mark.parametrize("spec", [False, "fixed", "adaptive", "measured"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphs_match_eager(spec, temperature, tmp_path):
    if temperature and spec == "fixed":
        pytest.skip("seeded sampling is compared draw by draw in test_seeded_graphed_step_parts_only_at_near_ties")
    if temperature and spec in ("adaptive", "measured"):
        pytest.skip("eager and graphed engines profile different cost tables, so their budgets (and the "
                    "seeded draws' positions) differ legitimately; greedy covers adaptive")
    prompts = _prompts(19)  # 19 -> 24, then fewer as requests finish: padded sizes
    params = [SamplingParams(temperature=temperature, max_tokens=8 + 5 * (i % 7), ignore_eos=True, seed=i)
              for i in range(19)]
    eager = _llm(True, spec, tmp=tmp_path, async_scheduling=False if not spec else None)
    graphed = _llm(False, spec, tmp=tmp_path)
    assert _graph_steps(eager) == 0
    # auto: async (speculation: pipelined speculative steps, spec_decode/pipelined.py)
    assert graphed.llm_engine.async_scheduling and (not spec or graphed.llm_engine._pipelines_spec())
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    if temperature:
        # the graph pads the batch, so its float32 probabilities differ from the eager ones by
        # rounding, and a seeded draw whose uniform lies within that of a CDF boundary may flip
        # (spec_decode/lockstep.py). Deep in the vocabulary a float32 cumulative sum is itself
        # ~1e-6 off: H100 run 50's request 10 parted at its token 10 in a cluster of rare tokens,
        # the H100's two tokens 5e-7 and 8e-7 from the CPU's uniform (test_lockstep.py). So a
        # request may part only where the eager engine's draw lies within 10 x NEAR_TIE of another
        # token (draw_margin_after), and at most 2 of 19 may: a wrong seed, position or
        # temperature parts nearly every request, at margins mostly far above that
        for i, (w, g) in enumerate(zip(want, got)):
            if w != g:
                j = next((n for n, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
                token, margin = draw_margin_after(eager.llm_engine, prompts[i], w[:j], params[i])
                print(f"request {i}: token {j} {g[j:j + 1]} against {w[j:j + 1]}; eager draws {token}, margin {margin:.2e}")
                assert margin < 10 * NEAR_TIE, f"request {i} parted at a margin of {margin:.2e}: not rounding; " \
                                               + _divergence(got, want, params)
        assert sum(a == b for a, b in zip(want, got)) >= len(want) - 2, _divergence(got, want, params)
    else:
        same = sum(a == b for a, b in zip(want, got))
        first = next(((i, a, b) for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        assert same == len(want), f"{same}/{len(want)} requests identical; first difference {first}"
    assert _graph_steps(graphed) > 5
    if spec == "measured":  # its pipelined steps were timed (LLMEngine._time_spec_step)
        assert graphed.llm_engine.stats.num_pipelined_steps > 5 and graphed.llm_engine.spec.policy.step_costs.num_observed > 0
    if temperature and not spec:  # the plain step sampled inside its sampling graphs (graphed_sampling.py)
        assert graphed.llm_engine._decode_sampler.num_replays > 5


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_mixed_graphs_match_eager_with_arrivals(spec):
    """Requests arrive while others decode (8 slots, 19 prompts): steps with prefill chunks replay
    a mixed graph (decodes and chunks together, logits at each request's last row), float32 greedy
    tokens equal the eager engine's. With speculation the decoding rows take the speculative
    step's graphs and the prefill chunks a mixed graph that captures the drafter's target layers;
    the acceptance must then match the eager engine's too (a wrong context row would lower it)."""
    prompts = _prompts(19)
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 7), ignore_eos=True) for i in range(19)]
    cfg = {"method": "dspark", "num_speculative_tokens": 5, "draft_sample_method": "greedy"} if spec else None
    kw = dict(max_num_seqs=8, device="cuda", dtype="float32", max_num_batched_tokens=256, speculative_config=cfg)
    eager = LLM("tiny", enforce_eager=True, async_scheduling=False if not spec else None, **kw)
    graphed = LLM("tiny", cudagraph_mode="FULL", **kw)
    runner = graphed.llm_engine.runner
    assert runner.graphs.mixed, "no mixed graphs were captured"
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert runner.num_mixed_graph_steps > 5 and runner.num_split_steps == 0
    if spec:
        a, b = eager.llm_engine.stats, graphed.llm_engine.stats
        assert b.num_graphed_steps > 5
        # float32 near-ties may flip a draft now and then: within 2% of the eager engine's
        assert abs(b.num_accepted_tokens - a.num_accepted_tokens) <= 0.02 * a.num_accepted_tokens


def test_fused_mixed_steps_run_as_one_forward_and_keep_the_targets_outputs(tmp_path):
    """adaptive_verification_mixed_steps "fused" on the pipelined graphed engine, with a cost
    table shaped like a GPU's (flat to 64 tokens, then linear) so that steps carrying prompt chunks
    do not draft while decode-only steps do: those steps run as one mixed-graph forward after the
    step in flight is read back, and greedy float32 outputs equal the plain engine's."""
    from adaspec.spec_decode.cost_model import CostModel, CostTable
    from adaspec.spec_decode.policy import AdaptivePolicy

    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    knee = CostModel(CostTable(sizes, [10 + 0.5 * max(0, n - 64) for n in sizes]), CostTable(sizes, [1.0] * len(sizes)))
    prompts = _prompts(19)
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 7), ignore_eos=True) for i in range(19)]
    cfg = {"method": "dspark", "num_speculative_tokens": 5, "draft_sample_method": "greedy",
           "enable_adaptive_verification": True, "adaptive_verification_mixed_steps": "fused",
           "cost_model_cache_dir": str(tmp_path)}
    kw = dict(max_num_seqs=8, device="cuda", dtype="float32", max_num_batched_tokens=256)
    want = [o.outputs[0].token_ids for o in LLM("tiny", enforce_eager=True, **kw).generate(prompts, params)]
    llm = LLM("tiny", cudagraph_mode="FULL", speculative_config=cfg, **kw)
    eng = llm.llm_engine
    assert eng.async_scheduling and eng._pipelines_spec()
    eng.spec.policy = AdaptivePolicy(knee, k=5, probe_every=1000, mixed_steps="fused")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want, _divergence(got, want, params)
    st = eng.stats
    assert st.num_mixed_steps_fused > 0 and st.num_draft_tokens > 0 and st.num_pipelined_steps > 0
    assert eng.runner.num_mixed_graph_steps >= st.num_mixed_steps_fused and eng.runner.num_split_steps == 0
    assert eng.kv_blocks_free() == eng.kv_blocks_total() and not eng.has_unfinished_requests()


def test_async_scheduling_equals_sync_on_gpu():
    """Seeded T = 1 with stop tokens (requests stop while their next step is in flight): the
    graphed engine with and without async scheduling, token for token."""
    prompts = _prompts(19)
    params = [SamplingParams(temperature=1.0, max_tokens=8 + 5 * (i % 7), seed=i, ignore_eos=True,
                             stop_token_ids=[int(t) for t in range(10 + i, 8000, 97)]) for i in range(19)]
    runs = {}
    for a in (False, True):
        llm = _llm(False, False, async_scheduling=a)
        runs[a] = ([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)],
                   llm.llm_engine)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].stats.num_discarded_rows > 0 and _graph_steps(llm) > 5


@pytest.mark.parametrize("spec", ["fixed", "adaptive", "measured"])
def test_pipelined_spec_steps_equal_sync_on_a_busy_gpu(spec, monkeypatch, tmp_path):
    """Pipelined speculative steps on the GPU, kept busy (a spin kernel queued before every graphed
    launch, so step t's input copies are still queued when the host fills step t + 1's): seeded
    T = 1 with stop tokens (requests end while their next step is in flight), arrivals (prefill
    rows ride along and sit the next step out). Fixed k: token for token the synchronous engine's
    (but for a first token drawn at a near-tie, below);
    adaptive (its budgets come from confidences a step older), and adaptive on measured step costs
    (pipelined since b591e30, its steps timed from their read backs): greedy tokens equal no-spec's."""
    from adaspec.spec_decode.graphed_step import GraphedSpecStep

    prompts = _prompts(19)
    temperature = 1.0 if spec == "fixed" else 0.0
    # rows with logprobs and (sampled) top-p ride along: their part is redone after the replay and
    # their logprobs copied out beside the read back (spec_decode/graphed_extras.py)
    def extra(i):
        return dict(logprobs=1) if i % 5 == 1 else dict(top_p=0.9) if i % 5 == 2 and temperature else {}

    params = [SamplingParams(temperature=temperature, max_tokens=8 + 5 * (i % 7), seed=i, ignore_eos=True,
                             stop_token_ids=[int(t) for t in range(10 + i, 8000, 97)], **extra(i)) for i in range(19)]
    if spec == "fixed":
        want = [o.outputs[0].token_ids for o in _llm(False, spec, async_scheduling=False).generate(prompts, params)]
    else:
        want = [o.outputs[0].token_ids for o in _llm(False, False).generate(prompts, params)]
    real = GraphedSpecStep.launch

    def slow_launch(self, *args, **kw):
        torch.cuda._sleep(2_000_000)  # ~1 ms of spinning ahead of this step's copies
        return real(self, *args, **kw)

    monkeypatch.setattr(GraphedSpecStep, "launch", slow_launch)
    llm = _llm(False, spec, tmp=tmp_path)
    llm.llm_engine.scheduler.max_num_seqs = 8  # arrivals while others decode
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    st = llm.llm_engine.stats
    assert st.num_pipelined_steps > 10 and st.num_discarded_rows > 0
    # The pipelined engine prefills its arrivals beside speculative rows, the synchronous one all 19
    # at once: the prefill's float32 probabilities then differ by rounding, and a first token drawn
    # within rounding of a CDF boundary can flip, or a top-p row whose cutoff lies within rounding
    # keeps another set of tokens and draws apart at any margin (request 12 on some H200s since
    # runs 36-37, every engine version since 2812717; run 40 measured its draw margin at 4.5e-5 and
    # its top-p cutoff 2e-7 from 0.9: tests/spec_decode/test_lockstep.py). So a request may part at
    # its first token, at a near-tie of the eager engine's draw or filter (first_draw_margin); every
    # token the speculative steps drew must agree.
    eager = _llm(True, spec).llm_engine if got != want else None
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert g[:1] != w[:1], "parted after the first token: " + _divergence(got, want, params)
            token, margin = first_draw_margin(eager, prompts[i], params[i])
            print(f"request {i}: first token {g[:1]} against {w[:1]}; eager draws {token}, margin {margin:.2e}")
            assert margin < NEAR_TIE, f"request {i}'s first draw parted at a margin of {margin:.2e}: " \
                                      "not rounding; " + _divergence(got, want, params)


def test_async_inputs_survive_a_busy_gpu(monkeypatch):
    """The GPU is kept busy (a spin kernel queued before every refresh), so step t's input copies are
    still queued when the host fills step t+1's: the pinned mirrors must alternate (or be waited on)
    and never be rewritten before their copies ran. Greedy tokens equal the synchronous engine's
    (one mirror set refilled without a wait would hand step t the inputs of step t+1)."""
    from adaspec.engine.cuda_graphs import GraphedForward

    prompts = _prompts(12)
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True) for i in range(12)]
    want = [o.outputs[0].token_ids for o in _llm(False, False, async_scheduling=False).generate(prompts, params)]
    real = GraphedForward._refresh

    def slow_refresh(self, *args, **kw):
        torch.cuda._sleep(2_000_000)  # ~1 ms of spinning ahead of this step's copies
        return real(self, *args, **kw)

    monkeypatch.setattr(GraphedForward, "_refresh", slow_refresh)
    llm = _llm(False, False, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert _graph_steps(llm) > 5


def test_seeded_graphed_step_parts_only_at_near_ties():
    """Fixed k at T = 1, probabilistic drafts: the graphed engine in lockstep with the eager one;
    a request whose tokens differ must have parted at a draw within rounding of its threshold
    (tests/spec_decode/test_lockstep.py shows a wrong seed is caught on CPU)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from graph_divergence_check import engine, requests

    for s in (19, 20):
        found, n = run_lockstep(engine(False, "cuda", 5), engine(True, "cuda", 5), requests(19, s))
        assert all(d.explained() for d in found), [d for d in found if not d.explained()]
        assert len(found) <= 3, f"{len(found)} of {n} requests differ: {found}"


@pytest.mark.parametrize("spec, extras", [(False, False), ("fixed", False), ("adaptive", False), ("fixed", True),
                                           ("adaptive", True)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decode_step_syncs_once(temperature, spec, extras, tmp_path):
    """extras: some requests want logprobs or top-p, whose part of a graphed step is redone after
    the replay (spec_decode/graphed_extras.py): that work must not sync either."""
    llm = _llm(False, spec, dtype="bfloat16", tmp=tmp_path)
    eng = llm.llm_engine
    for i, p in enumerate(_prompts(8)):
        more = {} if not extras or i % 3 == 0 else dict(logprobs=2) if i % 3 == 1 else dict(top_p=0.9)
        eng.add_request(str(i), p, SamplingParams(temperature=temperature, max_tokens=50, ignore_eos=True, seed=i,
                                                  **more))
    for _ in range(3):  # prefill, then decodes
        eng.step()
    assert all(s.is_decoding for s in eng.scheduler.running)
    graphed = eng.spec.graphed if eng.spec is not None else None
    for _ in range(5):  # several steps: blocks fill up, requests cross block boundaries
        waits = eng.num_result_waits
        reads = graphed.num_read_backs if graphed is not None else 0
        where = device_sync_sites(eng.step)
        if eng.async_scheduling and graphed is not None:
            # pipelined speculative steps: each reads back the step launched before it (an event
            # wait, which the debug mode does not see), and nothing else
            w, r = eng.num_result_waits - waits, graphed.num_read_backs - reads
            assert not where and (w, r) == (0, 1), f"syncs: {where}, waits {w}, read backs {r}"
        elif eng.async_scheduling:  # the event wait for the previous step's tokens (the debug mode may not see it)
            others = [w for w in where if not w.startswith("async_step.py")]
            assert not others and eng.num_result_waits == waits + 1, f"syncs: {where}"
        elif graphed is not None:  # the graphed step's one wait is an event wait, which the debug mode does not see
            assert not where and graphed.num_read_backs == reads + 1, \
                f"syncs: {where}, read backs: {graphed.num_read_backs - reads}"
        else:
            assert len(where) == 1, f"a decode step made {len(where)} device-to-host syncs: {where}"
    assert _graph_steps(llm) >= 5


def test_adaptive_plain_async_steps_on_gpu():
    """Adaptive speculation under async scheduling without the speculative step's graphs (eager:
    LLMEngine._adaptive_async_step; with graphs the steps are pipelined, every setting included,
    since b591e30): four plain async steps (the drafter's context written on the device), then
    one that drafts, over and over. float32 greedy tokens equal the no-spec engine's, and the
    acceptance is a synchronous engine's with the same steps drafting: a context row written wrong
    or not at all would lower it."""
    prompts = _prompts(19)
    params = [SamplingParams(temperature=0, max_tokens=20 + 5 * (i % 7), ignore_eos=True) for i in range(19)]
    # measured step costs: the policy times the plain async steps it launches (policy.step_started)
    # (the step overhead pinned to 0, the tables alone: a measured one follows wall time, and the two
    # engines compared must verify alike)
    cfg = {"method": "dspark", "num_speculative_tokens": 5, "draft_sample_method": "greedy",
           "enable_adaptive_verification": True, "adaptive_verification_step_costs": "measured",
           "adaptive_verification_step_overhead_ms": 0}
    # every request admitted and prefilled at once: the two engines then run the same steps (a
    # skipped step of the synchronous one reserves draft slots, which would chunk prefills apart)
    kw = dict(max_num_seqs=24, device="cuda", dtype="float32", max_num_batched_tokens=2048, enforce_eager=True)
    want = [o.outputs[0].token_ids for o in LLM("tiny", **kw).generate(prompts, params)]
    stats = []
    for async_mode in (False, True):
        llm = LLM("tiny", speculative_config=cfg, async_scheduling=async_mode, **kw)
        eng = llm.llm_engine
        drafts_at = lambda n: n % 5 == 0  # noqa: E731
        if async_mode:
            eng.spec.policy.should_draft = lambda *a, **kw: drafts_at(eng.stats.num_steps + 1)
            eng.spec.policy.plain_step_done = lambda *a: drafts_at(eng.stats.num_steps + 1)
        else:
            eng.spec.policy.should_draft = lambda *a, **kw: drafts_at(eng.stats.num_steps)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
        assert eng.async_scheduling == async_mode and eng.stats.num_steps_draft_skipped > 10
        assert eng.spec.graphed is None and (not async_mode or eng.num_result_waits > 10)  # plain async steps ran
        stats.append(eng.stats)
    a, b = stats
    assert a.num_accepted_tokens > 0
    assert abs(b.num_accepted_tokens - a.num_accepted_tokens) <= 0.02 * a.num_accepted_tokens


@pytest.mark.parametrize("spec", ["fixed", "adaptive"])
def test_logprobs_and_filters_stay_in_the_graphs_on_gpu(spec, tmp_path):
    """Rows with top-k / top-p or logprobs run in the speculative step's graphs, their part redone
    after the verify replay (spec_decode/graphed_extras.py), pipelined like the others: top_k = 1
    at T = 1 gives the greedy tokens, greedy rows with logprobs give the eager plain engine's tokens
    and chosen-token logprobs, top-p rows finish."""
    prompts = _prompts(19)
    base = dict(max_tokens=8 + 5 * 3, ignore_eos=True)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=i, **base) if i % 3 == 0 else
              SamplingParams(temperature=0.0, logprobs=2, **base) if i % 3 == 1 else
              SamplingParams(temperature=0.9, top_p=0.9, seed=i, **base) for i in range(19)]
    greedy = SamplingParams(temperature=0.0, logprobs=2, **base)
    plain = _llm(True, False, async_scheduling=False).generate(prompts, [greedy] * 19)
    llm = _llm(False, spec, tmp=tmp_path)
    outs = llm.generate(prompts, params)
    for i, (o, p) in enumerate(zip(outs, plain)):
        assert len(o.outputs[0].token_ids) == base["max_tokens"]
        if i % 3 != 2:
            assert o.outputs[0].token_ids == p.outputs[0].token_ids, i
        if i % 3 == 1:
            got, want = o.outputs[0].logprobs, p.outputs[0].logprobs
            assert len(got) == len(want) == base["max_tokens"]
            for tok, g, w in zip(o.outputs[0].token_ids, got, want):
                assert abs(g[tok] - w[tok]) < 1e-3
    st = llm.llm_engine.stats
    assert st.num_graphed_steps > 5 and st.num_pipelined_steps > 5 and st.num_pipeline_drains == 0


def test_a_failed_sampling_graph_capture_leaves_the_eager_sampler(monkeypatch):
    """The sampling graphs are an optimization: when their capture fails the engine still starts,
    warns, and its plain steps sample eagerly after the decode graph, giving the same seeded tokens."""
    from adaspec.engine.graphed_sampling import GraphedDecodeSampler

    def broken(self, eager=False):
        raise RuntimeError("capture failed on purpose")

    prompts = _prompts(5)
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=i) for i in range(5)]
    want = [o.outputs[0].token_ids for o in _llm(False, False).generate(prompts, params)]
    monkeypatch.setattr(GraphedDecodeSampler, "capture", broken)
    llm = _llm(False, False)
    assert llm.llm_engine._decode_sampler is None and llm.llm_engine.runner.graphs is not None
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.llm_engine.runner.num_graph_steps > 5


@pytest.mark.parametrize("spec", [False, "fixed", "adaptive"])
def test_rows_with_logits_rules_beside_graphed_rows_match_the_eager_engine(spec, tmp_path):
    """Penalties, logit_bias and min_tokens (sample/logits_rules.py) on every other request: those
    rows leave the plain engine's sampling graphs (under async scheduling their last token counted
    from the device); the speculative step's graphs serve them, their verification redone after
    the replay (spec_decode/graphed_extras.py; such steps synchronous), no decoding row left to
    the eager step; every request's greedy tokens are the eager engine's."""
    prompts = _prompts(12)
    ruled = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.4,
                           repetition_penalty=1.3, logit_bias={202: -3.0, 11: 2.0}, min_tokens=5)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [ruled if i % 2 else plain for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in _llm(True, spec, tmp=tmp_path).generate(prompts, params)]
    graphed = _llm(False, spec, tmp=tmp_path)
    if spec:
        no_eager_decodes(graphed)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want, _divergence(got, want, params)


@pytest.mark.parametrize("spec", [False, "fixed", "adaptive"])
def test_prompt_logprobs_with_graphs_match_the_eager_engine(spec, tmp_path):
    """prompt_logprobs (engine/prompt_logprobs.py) beside graphed decode rows: a chunk asking for all
    its rows' logits runs eagerly (or as a verify graph of its length), the pipelined speculative
    step's prefill launch records them too; values within float32 rounding of the eager engine's,
    ranks and greedy tokens equal."""
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2 if i % 2 else None)
              for i in range(len(prompts))]
    want = _llm(True, spec, tmp=tmp_path).generate(prompts, params)
    got = _llm(False, spec, tmp=tmp_path).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        if w.prompt_logprobs is None:
            continue
        for tok, gd, wd in zip(w.prompt_token_ids[1:], g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert abs(float(gd[tok]) - float(wd[tok])) < 1e-4 and gd[tok].rank == wd[tok].rank


@pytest.mark.parametrize("spec", [False, "fixed", "adaptive"])
def test_structured_outputs_beside_graphed_rows_match_the_eager_engine(spec, tmp_path):
    """A regex and a choice constraint (sample/structured_outputs.py) on some requests: their rows
    sample eagerly in the plain engine and are redone after the speculative step's verify replay
    (no decoding row left to its eager step), a step in flight that sampled for one is read back
    before the next (async scheduling, pipelined speculative steps), and every request's greedy
    tokens are the eager engine's; the constrained outputs follow their constraint."""
    import re

    pytest.importorskip("llguidance")  # a GPU machine may lack it (the test extras install it)
    from adaspec.sampling_params import StructuredOutputsParams as SO

    prompts = _prompts(12)
    regex = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex=r"[0-9]{2,4}-[a-z ]{3,30}\."))
    choice = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(choice=["alpha", "beta gamma"]))
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [(plain, regex, plain, choice)[i % 4] for i in range(len(prompts))]
    want = [o.outputs[0] for o in _llm(True, spec, tmp=tmp_path).generate(prompts, params)]
    graphed = _llm(False, spec, tmp=tmp_path)
    if spec:
        no_eager_decodes(graphed)
    got = [o.outputs[0] for o in graphed.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want], \
        _divergence([o.token_ids for o in got], [o.token_ids for o in want], params)
    for o, p in zip(got, params):
        if p is choice:
            assert o.text in ("alpha", "beta gamma")
        elif p is regex and o.finish_reason == "stop":
            assert re.fullmatch(r"[0-9]{2,4}-[a-z ]{3,30}\.", o.text), o.text
