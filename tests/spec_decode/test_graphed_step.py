"""The speculative step's graphed decode path (spec_decode/graphed_step.py), on CPU.

capture(eager=True) replays by running the captured functions eagerly over the same static
buffers, so everything but the capture itself is checked here: the device-built packed layout,
padding to captured batch sizes and query levels, drafts fed to the verification without a
host round trip, the drafter's context written inside the verify function, rejection sampling
and the one read back. Greedy outputs must equal the plain engine's; seeded sampled outputs
must equal the eager speculative step's, token for token, for fixed k and adaptive."""
import json

import numpy as np
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.spec_decode.graphed_step import GraphedSpecStep, GraphPaddedCost, packed_layout, query_levels
from adaspec.spec_decode.policy import AdaptivePolicy
from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir, no_eager_decodes, use_eager_spec_graphs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphed")
    target = make_micro_model_dir(root / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    drafter = make_bigram_drafter_dir(root / "drafter", target, block_size=7)
    return str(target), str(drafter)


def _prompts(n=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (L,), generator=g).tolist() for L in torch.randint(2, 30, (n,), generator=g).tolist()]


def _llm(pair, tmp_path, k, adaptive, graphed: bool, greedy_drafts=False, arrivals=True):
    """arrivals: 6 slots for 10 prompts, so requests arrive while others decode (mixed steps, split
    between the graphs and the eager step); else every prompt is prefilled in the first step."""
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": k,
           "enable_adaptive_verification": adaptive, "cost_model_cache_dir": str(tmp_path),
           "draft_sample_method": "greedy" if greedy_drafts else "probabilistic",
           # the tables alone: a measured overhead follows wall time, and the two steps must plan alike
           "adaptive_verification_step_overhead_ms": 0}
    slots, budget = (6, 64) if arrivals else (12, 1024)
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=slots, max_num_batched_tokens=budget, block_size=8)
    spec = llm.llm_engine.spec
    steps = GraphedSpecStep(spec, llm.llm_engine, batch_sizes=[1, 2, 4, slots])
    steps.capture(eager=True)
    if graphed:
        spec.use_graphs(steps)
    elif adaptive:  # the eager step budgets with the graphed step's prices, so both plan alike
        spec.policy = AdaptivePolicy(GraphPaddedCost(spec.cost_model, steps), k)
    return llm


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(pair):
    return [o.outputs[0].token_ids for o in LLM(pair[0]).generate(_prompts(), GREEDY)]


@pytest.mark.parametrize("k, adaptive", [(3, False), (7, False), (7, True)])
def test_graphed_greedy_equals_plain(pair, plain_greedy, tmp_path, k, adaptive):
    llm = _llm(pair, tmp_path, k, adaptive, graphed=True)
    outs = llm.generate(_prompts(), GREEDY)
    eng = llm.llm_engine
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    st = eng.stats
    assert eng.stats.num_graphed_steps > 10, "the graphed path was meant to run the decode steps"
    assert 0 < st.num_accepted_tokens < st.num_verified_tokens
    assert st.num_generated_tokens == st.num_accepted_tokens + st.num_bonus_tokens + st.num_sampled_without_draft
    assert eng.kv_blocks_free() == eng.kv_blocks_total()
    if not adaptive:  # fixed k verifies every slot it may: the rest were capped near max_tokens
        assert st.num_verified_tokens == st.num_draft_tokens - st.num_capped_draft_slots


@pytest.mark.parametrize("k, adaptive, greedy_drafts", [(3, False, False), (7, True, False), (7, False, True)])
def test_graphed_seeded_sampling_equals_eager_step(pair, tmp_path, k, adaptive, greedy_drafts):
    params = [SamplingParams(temperature=0.8 + 0.1 * (i % 3), max_tokens=24, ignore_eos=True, seed=100 + i)
              for i in range(len(_prompts()))]
    params[3] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # a greedy row in the batch
    # adaptive: a mixed step split in two plans two budgets where the eager step plans one (a
    # different batch composition: README, "Seeds"), so its comparison runs without arrivals
    arrivals = not adaptive
    eager_llm = _llm(pair, tmp_path, k, adaptive, graphed=False, greedy_drafts=greedy_drafts, arrivals=arrivals)
    eager = eager_llm.generate(_prompts(), params)
    llm = _llm(pair, tmp_path, k, adaptive, graphed=True, greedy_drafts=greedy_drafts, arrivals=arrivals)
    graphed = llm.generate(_prompts(), params)
    assert llm.llm_engine.stats.num_graphed_steps > 10
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    # the same drafts verified, step for step (the adaptive budgets and their allocation agree)
    a, b = eager_llm.llm_engine.stats, llm.llm_engine.stats
    assert (a.num_verified_tokens, a.verify_len_hist) == (b.num_verified_tokens, b.verify_len_hist)


FILTERED = [dict(top_p=0.9), dict(top_k=5), dict(logprobs=2), dict(top_p=0.8, top_k=3, logprobs=0), {}]


@pytest.mark.parametrize("k, adaptive", [(3, False), (7, True)])
def test_filters_and_logprobs_run_in_the_graphs_as_in_the_eager_step(pair, tmp_path, k, adaptive):
    """Rows with top-k / top-p or logprobs stay in the graphs (graphed_extras.py redoes their part
    after the verify replay) and emit what the eager step emits: with greedy drafts both judge the
    same drafts against the same filtered distributions with the same keyed uniforms."""
    params = [SamplingParams(temperature=0.9 if i % 4 else 0, max_tokens=24, ignore_eos=True, seed=200 + i,
                             **FILTERED[i % len(FILTERED)]) for i in range(len(_prompts()))]
    arrivals = not adaptive  # as in test_graphed_seeded_sampling_equals_eager_step
    eager = _llm(pair, tmp_path, k, adaptive, graphed=False, greedy_drafts=True, arrivals=arrivals).generate(
        _prompts(), params)
    llm = _llm(pair, tmp_path, k, adaptive, graphed=True, greedy_drafts=True, arrivals=arrivals)
    no_eager_decodes(llm)
    cache, builds = llm.llm_engine.spec._row_extras, []
    build = cache._build
    cache._build = lambda seqs, device: builds.append(1) or build(seqs, device)
    graphed = llm.generate(_prompts(), params)
    assert llm.llm_engine.stats.num_graphed_steps > 10
    # the rows' extras are built again only when the launch's requests change, not every launch
    assert 0 < len(builds) < llm.llm_engine.stats.num_graphed_steps
    for e, g, sp in zip(eager, graphed, params):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        if sp.logprobs is None:
            assert g.outputs[0].logprobs is None
            continue
        assert len(g.outputs[0].logprobs) == 24
        for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs):
            assert le.keys() == lg.keys() and len(lg) <= sp.logprobs + 1
            assert all(abs(le[t] - lg[t]) < 1e-4 for t in le)


@pytest.mark.parametrize("drafts", [True, False])
def test_top_k_one_and_a_tiny_top_p_sample_the_argmax_in_the_graphs(pair, plain_greedy, tmp_path, drafts):
    """top_k = 1 (or top_p near 0) leaves the target one token: sampled at temperature 1 with
    sampled drafts, the output is the greedy one. Without the filters applied after the replay it is
    not (a test of the fix-up, drafting and, with drafts off, the graph of steps that do not draft)."""
    llm = _llm(pair, tmp_path, 7, True, graphed=True)
    if not drafts:
        llm.llm_engine.spec.policy.should_draft = lambda *a, **kw: False
    no_eager_decodes(llm)
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=i,
                             **(dict(top_k=1) if i % 2 else dict(top_p=1e-6))) for i in range(len(_prompts()))]
    outs = llm.generate(_prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    st = llm.llm_engine.stats
    assert st.num_graphed_steps > 10
    assert (st.num_verified_tokens > 0) == drafts


@pytest.mark.parametrize("variant, redo", [("fixed", "filter"), ("pipelined", "filter"), ("adaptive-narrow", "filter"),
                                           ("fixed", "rule"), ("adaptive-narrow", "rule")])
def test_a_filter_or_rule_that_removes_nothing_redoes_the_graphs_own_step(pair, tmp_path, monkeypatch, variant, redo):
    """top_k above the vocabulary filters nothing, and allowed_token_ids of the whole vocabulary
    masks nothing, yet each sends its row through graphed_extras' redo (a rule with its drafts read
    back for its history): with the same distributions, drafts, draft distributions and uniforms,
    the redo must write back exactly what the graph wrote (tokens, accepted drafts, carry), row by
    row, with sampled drafts, such rows among plain ones, carried rows (pipelined; ruled rows are
    never pipelined) and narrow drafts. A redo that read another row's drafts, draft
    distributions, positions or packed rows would differ."""
    from adaspec.spec_decode import graphed_extras

    k = 3 if variant != "adaptive-narrow" else 7
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": k, "cost_model_cache_dir": str(tmp_path),
           "enable_adaptive_verification": variant == "adaptive-narrow"}
    if variant == "adaptive-narrow":
        cfg["adaptive_draft_width"] = "budget"
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=6, max_num_batched_tokens=64, block_size=8,
              async_scheduling=variant == "pipelined")
    eng = llm.llm_engine
    use_eager_spec_graphs(llm, [1, 2, 4, 6])
    if variant == "adaptive-narrow":  # every step drafts (the micro pair's tables would skip most)
        eng.spec.policy.should_draft = lambda *a, **kw: True
    real, compared = graphed_extras.fix_up, []

    def checked(g, b, q, extras, drafts=None):
        rows = extras.redo_rows
        assert (extras.ruled is not None) == (redo == "rule")
        before = g.readback[rows, : g.k + 2].clone(), g.carry[rows].clone()
        out = real(g, b, q, extras, drafts)
        assert torch.equal(g.readback[rows, : g.k + 2], before[0]) and torch.equal(g.carry[rows], before[1])
        compared.append((q, len(rows)))
        return out

    monkeypatch.setattr(graphed_extras, "fix_up", checked)
    vocab = eng.model_config.vocab_size
    removes_nothing = dict(top_k=vocab + 7) if redo == "filter" else dict(allowed_token_ids=list(range(vocab)))
    params = [SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=300 + i,
                             **(removes_nothing if i % 3 else {})) for i in range(len(_prompts()))]
    llm.generate(_prompts(), params)
    assert sum(n for q, n in compared if q > 1) > 20, compared  # drafting steps' rows compared
    if variant == "pipelined":
        assert eng.stats.num_pipelined_steps > 5


def test_logprobs_of_a_step_that_does_not_draft(pair, tmp_path):
    """Logprobs through the graph of steps that do not draft: one per token, the chosen token's
    among them, equal to the plain engine's."""
    llm = _llm(pair, tmp_path, 3, False, graphed=True)
    llm.llm_engine.spec.policy.should_draft = lambda *a, **kw: False
    no_eager_decodes(llm)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    out = llm.generate(_prompts(3), sp)
    plain = LLM(pair[0]).generate(_prompts(3), sp)
    for o, p in zip(out, plain):
        assert o.outputs[0].token_ids == p.outputs[0].token_ids
        assert len(o.outputs[0].logprobs) == len(p.outputs[0].logprobs) == 8
        for lo, lp in zip(o.outputs[0].logprobs, p.outputs[0].logprobs):
            assert lo.keys() == lp.keys() and all(abs(lo[t] - lp[t]) < 1e-4 for t in lo)


def test_query_levels():
    assert query_levels(7) == [1, 3, 5, 8]
    assert query_levels(1) == [1, 2]
    assert query_levels(3) == [1, 2, 3, 4]
    assert query_levels(7, every=True) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_adaptive_graphs_capture_every_query_level(pair, tmp_path):
    """The adaptive step captures each query length 1 .. k + 1 (a fixed k the coarse levels): with
    coarse levels a budget of 3 drafts per request ran as 5 query tokens (below)."""
    for adaptive, want in ((True, [1, 2, 3, 4, 5, 6, 7, 8]), (False, [1, 3, 5, 8])):
        llm = _llm(pair, tmp_path, 7, adaptive, graphed=True)
        assert llm.llm_engine.spec.graphed.levels == want


@pytest.mark.parametrize("graphed", [False, True])
def test_a_fixed_k_below_the_block_drafts_k_slots_only(pair, tmp_path, graphed):
    """k = 3 with a block of 7: the drafter's heads (vocabulary projection, Markov steps) run for the
    3 slots that can be verified, in the graphed and the eager step, and the tokens stay plain's."""
    llm = _llm(pair, tmp_path, 3, False, graphed=graphed)
    drafter = llm.llm_engine.spec.drafter
    widths, inner = [], drafter.draft_block

    def draft_block(*a, **kw):
        prop = inner(*a, **kw)
        widths.append(prop.tokens.shape[1])
        return prop

    drafter.draft_block = draft_block
    out = llm.generate(_prompts(4), GREEDY)
    assert widths and set(widths) == {3}
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in LLM(pair[0]).generate(_prompts(4), GREEDY)]


def test_budget_draft_width_drafts_fewer_slots_and_keeps_plain_tokens(pair, plain_greedy, tmp_path):
    """adaptive_draft_width "budget": the graphed step drafts the width the policy picks (here forced
    to the narrowest, 2 of 7, every other step, and the policy's own pick in between), the slots
    past it are never verified, the policy keeps its old confidences for them, and greedy decoding
    still equals plain decoding."""
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 7, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path), "adaptive_draft_width": "budget"}
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=6, max_num_batched_tokens=64, block_size=8)
    spec = llm.llm_engine.spec
    steps = GraphedSpecStep(spec, llm.llm_engine, batch_sizes=[1, 2, 4, 6])
    assert steps.widths == [2, 4, 7]
    steps.capture(eager=True)
    assert set(steps.propose_graphs) == {(b, w) for b in (1, 2, 4, 6) for w in (2, 4, 7)}
    spec.use_graphs(steps)
    drafter, policy = spec.drafter, spec.policy
    widths, picked = [], policy.draft_width
    calls = iter(range(10**6))

    def draft_width(ids, budget, limits, ws):
        return ws[0] if next(calls) % 2 == 0 else picked(ids, budget, limits, ws)

    def draft_block(*a, inner=drafter.draft_block, **kw):
        prop = inner(*a, **kw)
        widths.append(prop.tokens.shape[1])
        return prop

    policy.draft_width, drafter.draft_block = draft_width, draft_block
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]
    assert out == plain_greedy
    assert 2 in widths and max(widths) > 2 and llm.llm_engine.stats.num_graphed_steps > 10
    assert not np.isnan(policy.budget._conf).any()  # NaN slots never reach the stored confidences


def test_budget_draft_width_profiles_a_table_per_width(pair, tmp_path):
    """The cost tables of an engine with narrow drafts time each width's own draft: the eager
    propose of w slots (CPU), and on a graphed step each width's own propose graph (not the full
    one), so the policy prices a narrow draft as what it runs; the widths are in the cache key."""
    from adaspec.spec_decode.profiler import build_cost_model

    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 7, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path), "adaptive_draft_width": "budget", "profile_repeats": 1}
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=4, max_num_batched_tokens=64, block_size=8)
    spec = llm.llm_engine.spec
    assert sorted(spec.cost_model.draft_narrow) == [2, 4]  # the eager engine's (CPU) tables
    [cached] = tmp_path.glob("cost_model_*.json")
    assert json.loads(cached.read_text())["key"]["draft_widths"] == [2, 4]
    steps = use_eager_spec_graphs(llm, [1, 2, 4])
    replayed = []
    for key, graph in steps.propose_graphs.items():
        graph.replay = (lambda inner, key: lambda: (replayed.append(key), inner())[1])(graph.replay, key)
    model = build_cost_model(llm.llm_engine, spec, pair[1], cache=False)
    assert sorted(model.draft_narrow) == [2, 4]
    assert {w for _, w in replayed} == {2, 4, 7} and {b for b, _ in replayed} == {1, 2, 4}
    assert model.draft_narrow[2].sizes.tolist() == model.draft.sizes.tolist()


def test_cost_tables_are_cached_per_sampler_and_markov_loop(pair, tmp_path, monkeypatch):
    """Tables timed with one implementation of the sampler or the drafter's Markov loop (Triton
    kernels, torch ops) are never read back for a run with the other: both are in the cache key,
    so switching ADASPEC_FUSED_MARKOV or ADASPEC_TRITON_SAMPLING profiles afresh."""
    from adaspec.sample import kernels
    from adaspec.spec_decode.profiler import build_cost_model

    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path), "profile_repeats": 1}
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=2, max_num_batched_tokens=32, block_size=8)
    [first] = tmp_path.glob("cost_model_*.json")
    key = json.loads(first.read_text())["key"]
    assert (key["sampler"], key["markov_loop"]) == ("torch", "torch")  # the CPU's
    monkeypatch.setattr(kernels, "markov_loop_in_use", lambda device: "fused")
    build_cost_model(llm.llm_engine, llm.llm_engine.spec, pair[1])
    monkeypatch.setattr(kernels, "in_use", lambda device: "triton")
    build_cost_model(llm.llm_engine, llm.llm_engine.spec, pair[1])
    keys = sorted((k["sampler"], k["markov_loop"])
                  for k in (json.loads(p.read_text())["key"] for p in tmp_path.glob("cost_model_*.json")))
    assert keys == [("torch", "fused"), ("torch", "torch"), ("triton", "fused")]
    # the fused cache writes (ADASPEC_FUSED_KV_WRITE, in use on CUDA only) key tables of their own;
    # not in use, as on this CPU, keys stay as they were
    from adaspec.spec_decode import profiler

    monkeypatch.setattr(profiler, "kv_write_in_use", lambda device: "fused")
    build_cost_model(llm.llm_engine, llm.llm_engine.spec, pair[1])
    kv = sorted(k.get("kv_write", "-") for k in (json.loads(p.read_text())["key"] for p in tmp_path.glob("cost_model_*.json")))
    assert kv == ["-", "-", "-", "fused"] and "kv_write" not in key


def test_adaptive_draft_width_refuses_other_values(pair):
    from adaspec.errors import ConfigError

    with pytest.raises(ConfigError, match='adaptive_draft_width must be "full" or "budget", got .narrow.'):
        LLM(pair[0], speculative_config={"model": pair[1], "adaptive_draft_width": "narrow"})


def test_every_level_lets_the_policy_verify_three_drafts():
    """Cost tables shaped as the Qwen3-8B shape's on the H200 (run 17, 64 requests: verify ms by
    token rows, draft ms by requests) and run 16's acceptance curve: the objective's best budget is
    3 drafts per request, fixed k = 3's step. With the coarse levels 1, 3, 5, 8 that budget pays the
    5-token graph, and the policy took 4 drafts per request instead (a worse ratio); with every level
    it takes 3."""
    from adaspec.engine.cuda_graphs import capture_sizes
    from adaspec.spec_decode.cost_model import CostModel, CostTable
    from adaspec.spec_decode.graphed_step import GraphPaddedCost
    from adaspec.spec_decode.policy import budget_objective, choose_budget

    cost = CostModel(CostTable([64, 128, 192, 256, 384, 512], [6.76, 7.19, 8.53, 9.45, 12.92, 16.67]),
                     CostTable([1, 64], [0.89, 2.38]))
    surv = np.tile(np.cumprod([0.875, 0.749, 0.749, 0.745, 0.757, 0.783, 0.797]), (64, 1))

    class Graphs:
        def __init__(self, levels):
            self.batch_sizes, self.levels, self.verify_graphs = capture_sizes(64), levels, {None: None}

    chosen = {}
    for every in (False, True):
        priced = GraphPaddedCost(cost, Graphs(query_levels(7, every=every)))
        b = choose_budget(surv, 64, 64, 64, priced)
        chosen[every] = (b, budget_objective(surv, 64, 64, 64, priced)[b])
    assert chosen[False][0] == 4 * 64 and chosen[True][0] == 3 * 64
    assert chosen[True][1] > chosen[False][1]


def test_packed_layout_matches_host_packing():
    g = torch.Generator().manual_seed(0)
    B, K, bs, width, scratch = 5, 4, 4, 6, 99
    nq = torch.tensor([1, 3, 0, 5, 2])  # request 2 is padding
    start = torch.tensor([7, 0, 0, 13, 2])
    last = torch.randint(0, 50, (B,), generator=g)
    drafts = torch.randint(0, 50, (B, K), generator=g)
    tables = torch.randint(0, 40, (B, width), generator=g).int()
    T = 16
    ids, pos, slots, req, qs, kv = packed_layout(nq, start, last, drafts, tables, bs, scratch * bs, T)
    want_ids, want_pos, want_slots = [], [], []
    for r in range(B):
        for j in range(int(nq[r])):
            want_ids.append(int(last[r]) if j == 0 else int(drafts[r, j - 1]))
            p = int(start[r]) + j
            want_pos.append(p)
            want_slots.append(int(tables[r, p // bs]) * bs + p % bs)
    n = len(want_ids)
    pad = T - n
    assert ids.tolist() == want_ids + [0] * pad
    assert pos.tolist() == want_pos + [0] * pad
    assert slots.tolist() == want_slots + [scratch * bs] * pad
    assert qs.tolist() == [0] + np.cumsum(nq.numpy()).tolist()
    assert kv.tolist() == [8, 3, 0, 18, 4]


def test_graph_padded_cost_prices_the_graph_a_step_runs():
    from adaspec.spec_decode.graphed_step import GraphPaddedCost
    from adaspec.spec_decode.policy import step_verify_ms

    class Graphs:  # pick() as GraphedSpecStep's, batch sizes 1, 2, 4, 8 and levels 1, 3, 5, 8
        batch_sizes, levels, verify_graphs = [1, 2, 4, 8], [1, 3, 5, 8], {None: None}
        pick = GraphedSpecStep.pick

    class Linear:
        def verify_ms(self, n):
            return np.asarray(n, dtype=np.float64) * 1.0

        def draft_ms(self, r):
            return 0.5

    cost = GraphPaddedCost(Linear(), Graphs())
    # 3 requests pad to 4; 3 + 2 drafts fit 4 x 3 rows; 3 + 9 drafts need 4 x 5; no drafts: 4 x 1
    assert step_verify_ms(cost, 3, [3, 5, 12, 13, 20, 33]).tolist() == [4.0, 12.0, 12.0, 20.0, 20.0, 33.0]
    assert step_verify_ms(Linear(), 3, [3, 5]).tolist() == [3.0, 5.0]  # a plain cost model: tokens alone


def test_graph_padded_cost_remembers_its_answers_until_the_graphs_go():
    """verify_ms_for answers a repeated question from memory (the policy asks the same one every
    step of a steady load), the same answer as computed afresh, read-only; once the graphs are
    released a step runs unpadded, and so it is priced."""
    from adaspec.spec_decode.graphed_step import GraphPaddedCost

    class Graphs:
        batch_sizes, levels, verify_graphs = [1, 2, 4, 8], [1, 3, 5, 8], {None: None}

    class Counting:
        calls = 0

        def verify_ms(self, n):
            Counting.calls += 1
            return np.asarray(n, dtype=np.float64) * 2.0

    graphs = Graphs()
    cost = GraphPaddedCost(Counting(), graphs)
    first = cost.verify_ms_for(3, np.array([3, 5, 12]))
    again = cost.verify_ms_for(3, [3, 5, 12])  # a list or an array: the same question
    assert first.tolist() == again.tolist() == [8.0, 24.0, 24.0] and Counting.calls == 1
    with pytest.raises(ValueError):
        again[0] = 0.0  # callers add to the answer, never into it
    assert cost.verify_ms_for(3, [3]).tolist() == [8.0] and Counting.calls == 2  # another question
    assert cost.verify_ms_for(5, [5, 12]).tolist() == [16.0, 48.0] and Counting.calls == 3  # pads to 8 requests
    graphs.verify_graphs = {}  # released: steps run eagerly, unpadded
    assert cost.verify_ms_for(3, [3, 5, 12]).tolist() == [6.0, 10.0, 24.0] and Counting.calls == 4
    for n in range(2 * GraphPaddedCost.MEMO_SIZE):  # the memory stays bounded
        cost.verify_ms_for(1, [n])
    assert len(cost._memo) <= GraphPaddedCost.MEMO_SIZE


@pytest.mark.parametrize("extra", [{}, dict(top_p=0.9, logprobs=1)])
def test_synthetic_method_through_the_graphs(pair, extra):
    """method "synthetic": the graphed step drafts with the stand-in, accepts by the curve (rows
    redone after the replay too: graphed_extras.py)."""
    curve = [0.9, 0.5, 0.5, 0.5]
    cfg = {"method": "synthetic", "num_speculative_tokens": 4, "synthetic_acceptance": curve,
           "synthetic_confidence_noise": 0.0}
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=6, max_num_batched_tokens=64, block_size=8)
    use_eager_spec_graphs(llm, [1, 2, 4, 6])
    outs = llm.generate(_prompts(6), SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, **extra))
    st = llm.llm_engine.stats
    assert llm.llm_engine.stats.num_graphed_steps > 20 and st.synthetic_acceptance
    assert all((o.outputs[0].logprobs is not None) == bool(extra) for o in outs)
    n, a = st.verified_per_pos[0], st.accepted_per_pos[0]
    assert abs(a / n - 0.9) < 4 * (0.9 * 0.1 / n) ** 0.5, (a, n)


def test_graph_padded_cost_matches_pick_everywhere():
    from adaspec.engine.cuda_graphs import capture_sizes
    from adaspec.spec_decode.graphed_step import GraphPaddedCost

    class Graphs:
        batch_sizes, levels, verify_graphs = capture_sizes(64), query_levels(7), {None: None}
        pick = GraphedSpecStep.pick

    cost = GraphPaddedCost(None, Graphs())
    for r in (1, 3, 8, 13, 64, 65):
        tokens = np.arange(r, r * 8 + 3)
        want = []
        for t in tokens:
            key = Graphs().pick(r, int(t), drafting=t > r)
            want.append(int(t) if key is None else key[0] * key[1])
        assert cost.padded(r, tokens).tolist() == want, r


def test_mixed_steps_split_between_graphs_and_eager_step(pair, plain_greedy, tmp_path):
    """A request arriving while others decode: the decoding rows take the graphs, the prefill chunk
    the eager step, in the same engine step; tokens still equal plain decoding. Both parts are
    launched before the graphed one is read back, and the engine gets the graphed rows' tokens
    before the eager part is read back (its stop checks overlap the eager forward on a GPU)."""
    llm = _llm(pair, tmp_path, 3, True, graphed=True)
    spec = llm.llm_engine.spec
    events, split_steps = [], []
    inner = spec._launch

    def launch(rows, graphed, **kw):
        events.append(("launch", graphed, len(rows)))
        finish = inner(rows, graphed, **kw)

        def counted_finish():
            events.append(("finish", graphed, len(rows)))
            return finish()

        return counted_finish

    spec._launch = launch
    outer = spec.step

    def step(scheduled, on_ready):
        before = len(events)

        def ready(indices, results):
            events.append(("ready", None, len(indices)))
            on_ready(indices, results)

        outer(scheduled, ready)
        mine = events[before:]
        if sum(e[0] == "launch" for e in mine) == 2:
            split_steps.append(mine)

    spec.step = step
    outs = llm.generate(_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    assert split_steps, "no step mixed decoding rows with a prefill chunk"
    for ev in split_steps:
        (_, g1, n1), (_, g2, n2) = ev[0], ev[1]
        assert [e[0] for e in ev] == ["launch", "launch", "finish", "ready", "finish", "ready"]
        assert (g1, g2) == (True, False)
        assert ev[2] == ("finish", True, n1) and ev[3][2] == n1 and ev[4] == ("finish", False, n2)


def test_release_cuda_graphs_frees_them_and_the_engine_goes_on_eagerly(pair, plain_greedy, tmp_path):
    llm = _llm(pair, tmp_path, 3, False, graphed=True)
    eng = llm.llm_engine
    assert eng.spec.graphed is not None and eng.spec.graphed.verify_graphs
    graphed = eng.spec.graphed
    eng.release_cuda_graphs()
    assert eng.spec.graphed is None and not graphed.verify_graphs and not graphed.propose_graphs
    before = eng.stats.num_graphed_steps
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]
    assert got == plain_greedy and eng.stats.num_graphed_steps == before


def test_read_back_without_a_launch_is_an_error(pair, tmp_path):
    """The pinned read-back mirror belongs to the step launched last: reading with none launched
    (or reading twice) is a bookkeeping fault, not stale tokens."""
    llm = _llm(pair, tmp_path, 3, False, graphed=True)
    g = llm.llm_engine.spec.graphed
    with pytest.raises(RuntimeError, match="without a launched"):
        g.read_back()
    llm.generate(_prompts(3), GREEDY)  # steps launch and read back in pairs
    with pytest.raises(RuntimeError, match="without a launched"):
        g.read_back()


class _EveryLevelGraphs:  # what GraphPaddedCost reads of a GraphedSpecStep: batch sizes 1, 2, 4, 8, every level
    batch_sizes, levels, verify_graphs = [1, 2, 4, 8], list(range(1, 9)), {None: None}


def test_graph_padded_cost_prices_a_timed_graph_by_its_rows_and_level():
    """With the verify graphs timed (CostModel.verify_graph), a step is priced as its graph (B rows,
    Q tokens each) was timed; a level the tables do not hold, and a step no graph covers, fall back
    to the token table."""
    from adaspec.spec_decode.cost_model import CostModel, CostTable
    from adaspec.spec_decode.policy import step_verify_ms

    class Graphs:
        batch_sizes, levels, verify_graphs = [1, 2, 4, 8], [1, 3, 5, 8], {None: None}

    tokens = CostTable([1, 64], [1.0, 64.0])  # 1 ms a token
    cost = GraphPaddedCost(CostModel(tokens, CostTable([1], [0.5]),
                                     verify_graph={3: CostTable([1, 2, 4, 8], [10.0, 20.0, 40.0, 80.0]),
                                                   8: CostTable([1, 8], [100.0, 800.0])}), Graphs())
    # 3 requests run the graphs of 4: q = 1 (untimed: 4 token rows), q = 3 (timed: 40), q = 5 (untimed:
    # 20 token rows), q = 8 (timed: 400, interpolated between 1 and 8 rows), and 33 tokens no graph holds
    assert step_verify_ms(cost, 3, [3, 5, 12, 13, 20, 21, 32, 33]).tolist() == \
        [4.0, 40.0, 40.0, 20.0, 20.0, 400.0, 400.0, 33.0]


def test_timed_graphs_let_the_budget_follow_what_each_graph_costs():
    """A verify graph costs 1 ms + 0.05 ms a row + 0.004 ms a token row (rows cost attention's reads of
    their context). The token table times n tokens as n / 8 rows of 8, so at 8 requests it prices
    fewer drafts a request at fewer rows than the step has: it makes extra drafts look dearer than
    they are, and verifies too few. Priced from the timed graphs, the budget is the one a brute-force
    search over every B with the true cost picks."""
    from adaspec.spec_decode.cost_model import CostModel, CostTable
    from adaspec.spec_decode.policy import choose_budget

    def graph_ms(b, q):
        return 1.0 + 0.05 * b + 0.004 * b * q

    graphs = _EveryLevelGraphs()
    sizes = list(range(1, 65))
    tokens = CostTable(sizes, [graph_ms(-(-n // 8), 8) for n in sizes])  # as profiler.time_verify runs them
    draft = CostTable([1, 8], [0.3, 0.4])
    timed = {q: CostTable(graphs.batch_sizes, [graph_ms(b, q) for b in graphs.batch_sizes]) for q in graphs.levels}
    surv = np.tile(np.cumprod([0.8, 0.7, 0.65, 0.6, 0.6, 0.6, 0.6]), (8, 1))
    by_tokens = choose_budget(surv, 8, 8, 8, GraphPaddedCost(CostModel(tokens, draft), graphs))
    by_graphs = choose_budget(surv, 8, 8, 8, GraphPaddedCost(CostModel(tokens, draft, verify_graph=timed), graphs))

    flat = np.sort(surv.ravel())[::-1]
    rates = [(8 + flat[:b].sum()) / (0.4 + graph_ms(8, next(q for q in range(2 if b else 1, 9) if 8 * q >= 8 + b)))
             for b in range(flat.size + 1)]
    assert by_graphs == int(np.argmax(rates))
    assert by_tokens < by_graphs  # the token table verifies fewer: what the timed graphs repair


def test_the_profile_times_every_level_of_the_captured_verify_graphs(pair, tmp_path):
    """build_cost_model over a graphed step (capture(eager=True) on the CPU): the verify graphs are
    timed at every query level, at the grid of their batch sizes, and the policy's prices then come
    from those timings."""
    from adaspec.spec_decode.policy import step_verify_ms
    from adaspec.spec_decode.profiler import build_cost_model

    llm = _llm(pair, tmp_path, 7, True, graphed=True)
    spec = llm.llm_engine.spec
    model = build_cost_model(llm.llm_engine, spec, pair[1], cache=False)
    assert sorted(model.verify_graph) == list(range(1, 9))
    assert all(t.sizes.tolist() == [1, 2, 4, 6] for t in model.verify_graph.values())
    priced = GraphPaddedCost(model, spec.graphed)
    assert step_verify_ms(priced, 3, [3 + 3 * 5]).tolist() == [model.verify_graph_ms(4, 5)]  # 18 tokens: 4 x 5
    assert step_verify_ms(priced, 6, [6 * 8]).tolist() == [model.verify_graph_ms(6, 8)]
