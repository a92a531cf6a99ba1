"""The CUDA-graph buffers with speculation, on CPU through Triton's interpreter (the plain half and
what both share: test_graph_buffers.py, graph_buffers_common.py): verification rows packed into the
graphs, prefill chunks of a speculative engine replaying mixed graphs that capture the drafter's
target layers, and adaptive speculation's plain steps writing the drafter's context in the graphs."""
import pytest
import torch
from graph_buffers_common import _prompts, check_graph_buffers_match_eager, make_pair, needs_kernels

from adaspec import LLM, SamplingParams
from adaspec.engine.cuda_graphs import GraphedForward
from adaspec.testing import assert_same_proposals, record_proposals, use_eager_spec_graphs

pytestmark = needs_kernels
pair = pytest.fixture(scope="module", name="pair")(make_pair)


@pytest.mark.slow  # ~40 s: the Triton interpreter runs every attention call
def test_graph_buffers_match_eager_verify(pair):
    check_graph_buffers_match_eager(pair, spec=True)


@pytest.mark.slow  # the Triton interpreter runs every attention call
def test_spec_engine_prefill_chunks_replay_mixed_graphs(pair):
    """With speculation, the rows the speculative step's own graphs do not serve (prefill chunks of
    arriving requests) replay the target's mixed graphs, which capture the drafter's target layers
    for every row. Tokens equal the plain engine's (lossless either way), and the drafter's context
    cache, written from those layers, equals the one written after an eager prefill: a wrong row or
    layer there would only lower acceptance, which the tokens cannot show."""
    prompts = _prompts(7)  # 7 requests into 4 slots: three arrive while others decode
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(7)]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=40, device="cpu", skip_tokenizer_init=True)
    want = [o.outputs[0].token_ids for o in LLM(pair[0], attention_backend="reference", **kw).generate(prompts, params)]
    engines = {}
    for mixed in (False, True):
        # the engine without mixed graphs runs the reference attention backend (its speculative
        # step's graphs then use the paged torch one): a fraction of a second where the Triton
        # interpreter takes seconds per step
        llm = LLM(pair[0], speculative_config={"method": "dspark", "model": pair[1], "num_speculative_tokens": 3,
                                               "draft_sample_method": "greedy"},
                  attention_backend="triton" if mixed else "reference", **kw)
        eng = llm.llm_engine
        use_eager_spec_graphs(llm, [1, 2, 4])
        if mixed:
            g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, 4, query_lens=(1,),
                               max_model_len=eng.max_model_len,
                               max_blocks_per_seq=-(-(eng.max_model_len + 4) // eng.config.block_size),
                               scratch_block=eng.scratch_block, capture_layers=list(eng.spec.capture_layers),
                               mixed_sizes=[(2, 16), (4, 40)], write_context=eng.spec.setup.write_context)
            g.capture(eager=True)
            eng.runner.graphs = g
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        engines[mixed] = eng
    eager, graphed = engines[False], engines[True]
    assert graphed.runner.num_mixed_graph_steps > 3 and eager.runner.num_mixed_graph_steps == 0
    assert graphed.spec.num_context_rows_written_eagerly == 0  # the mixed graphs wrote every chunk's context
    assert graphed.stats.num_graphed_steps > 3 and graphed.stats.num_verified_tokens > 0
    owned = eager.scratch_block * eager.config.block_size  # the scratch block holds whatever padding wrote last
    torch.testing.assert_close([c[:owned] for layer in graphed.spec.kv_caches for c in layer],
                               [c[:owned] for layer in eager.spec.kv_caches for c in layer], atol=1e-5, rtol=1e-5)
    assert graphed.stats.num_accepted_tokens == eager.stats.num_accepted_tokens


def test_adaptive_plain_steps_replay_graphs_that_write_the_drafters_context(pair, tmp_path, monkeypatch):
    """Adaptive speculation's plain async steps replay the target's decode and mixed graphs, which
    write the drafter's context inside the graph (engine/cuda_graphs.py, write_context), so no
    eager write follows them. With a drafter that attends to its context, every proposal (drafts
    and confidences) equals the synchronous engine's, whose plain steps write it eagerly: a graph
    that wrote nothing, or wrote the wrong rows, changes them."""
    prompts = _prompts(4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path),
           # the tables alone: a measured overhead follows wall time (the two engines' differ), and
           # their budgets must agree for the proposals to
           "adaptive_verification_step_overhead_ms": 0}
    # the policy is scripted below: its tables are never read (profiling them in Triton's interpreter
    # would take most of this test's time)
    from adaspec.spec_decode import profiler
    from adaspec.spec_decode.cost_model import CostModel, CostTable

    monkeypatch.setattr(profiler, "build_cost_model", lambda *a, **kw: CostModel(CostTable([1, 64], [1.0, 2.0]),
                                                                                  CostTable([1, 8], [0.1, 0.2])))
    runs = []
    for graphed in (False, True):
        # the synchronous reference runs the reference attention backend (a fraction of a second
        # where the Triton interpreter takes seconds per step)
        llm = LLM(pair[0], speculative_config=cfg, attention_backend="triton" if graphed else "reference",
                  max_num_seqs=4, device="cpu", max_num_batched_tokens=64, skip_tokenizer_init=True,
                  async_scheduling=graphed)
        eng = llm.llm_engine
        spec = eng.spec
        if graphed:
            g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, 4, query_lens=(1,),
                               max_model_len=eng.max_model_len,
                               max_blocks_per_seq=-(-(eng.max_model_len + 4) // eng.config.block_size),
                               scratch_block=eng.scratch_block, capture_layers=list(spec.capture_layers),
                               mixed_sizes=[(4, 64)], write_context=spec.setup.write_context)
            g.capture(eager=True)
            eng.runner.graphs = g
        # step n (1-based) drafts iff n % 4 == 0, in both engines (the async one asks before a drafting
        # step is counted, or after a plain one; the synchronous one inside the counted step)
        ahead = 1 if graphed else 0
        spec.policy.should_draft = lambda *a, e=eng, d=ahead, **kw: (e.stats.num_steps + d) % 4 == 0
        spec.policy.plain_step_done = lambda *a, e=eng: (e.stats.num_steps + 1) % 4 == 0
        proposals = record_proposals(spec.drafter)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts))]
        runs.append((eng, tokens, proposals))
    (sync, want, ref), (eng, got, props) = runs
    assert got == want
    plain_replays = eng.runner.num_graph_steps + eng.runner.num_mixed_graph_steps
    assert plain_replays > 5 and eng.stats.num_steps_draft_skipped > 0 and eng.async_scheduling
    assert sync.runner.num_graph_steps == 0
    assert len(ref) >= 4
    assert_same_proposals(ref, props)
