"""The CUDA-graph buffer logic of steps that mix decodes with prefill chunks (mixed graphs, split
steps) and of a speculative engine's target graphs, which also write the drafter's context; on
CPU with the Triton kernel in its interpreter (graph_buffers_setup.py). Tokens, and the drafter's
context and proposals, must equal the eager engine's."""
import pytest
import torch

from graph_buffers_setup import graphed_engine, prompt_ids, needs_triton
from adaspec import LLM, SamplingParams
from adaspec.engine.cuda_graphs import GraphedForward
from adaspec.testing import assert_same_proposals, record_proposals

pytestmark = needs_triton


@pytest.mark.slow  # the Triton interpreter runs every attention call
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_steps_split_into_graph_and_eager_forward(graph_pair, async_scheduling):
    """Requests arrive while others decode (4 slots, 9 prompts): a step with a prefill chunk runs its
    decode rows through the graph and the chunk eagerly, and the tokens equal the eager engine's.
    Async: the decode rows' inputs come from the previous step's tokens on the device, in both the
    graph's static buffers and the eager forward's, and the graph's host buffers alternate."""
    prompts = prompt_ids(9)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(9)]
    eager = graphed_engine(graph_pair, graphs=False, spec=False)
    graphed = graphed_engine(graph_pair, graphs=True, spec=False, async_scheduling=async_scheduling)
    for llm in (eager, graphed):
        llm.llm_engine.scheduler.max_num_seqs = 4
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert graphed.llm_engine.runner.num_split_steps > 0


@pytest.mark.slow  # the Triton interpreter runs every attention call
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_graphs_run_decodes_and_prefill_chunks_in_one_replay(graph_pair, async_scheduling):
    """Requests arrive while others decode: steps with prefill chunks (and prefill-only steps) replay
    a mixed graph, padded in requests and tokens, whose logits are each request's last row; the
    tokens equal the eager engine's."""
    prompts = prompt_ids(9)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(9)]
    eager = LLM(graph_pair[0], attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
                skip_tokenizer_init=True)
    graphed = LLM(graph_pair[0], attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
                  skip_tokenizer_init=True, async_scheduling=async_scheduling)
    eng = graphed.llm_engine
    g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, 4, query_lens=(1,),
                       max_model_len=eng.max_model_len, max_blocks_per_seq=-(-eng.max_model_len // eng.config.block_size),
                       scratch_block=eng.scratch_block, capture_layers=None, mixed_sizes=[(2, 16), (4, 40)])
    g.capture(eager=True)
    eng.runner.graphs = g
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert eng.runner.num_mixed_graph_steps > 3 and eng.runner.num_graph_steps > 3
    assert eng.runner.num_split_steps == 0  # every mixed step fitted a mixed graph


@pytest.mark.slow  # the Triton interpreter runs every attention call
def test_split_steps_never_replay_a_mixed_graph(graph_pair):
    """A step no mixed graph holds (here: more than one request) is split; its parts run as the decode
    graph and eagerly, never as a mixed graph (the prefill part alone would fit this one), whose replay could reuse the decode graph's output
    memory (one capture pool) before those outputs are read. Tokens equal the eager engine's."""
    prompts = prompt_ids(9)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(9)]
    eager = LLM(graph_pair[0], attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
                skip_tokenizer_init=True)
    graphed = LLM(graph_pair[0], attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
                  skip_tokenizer_init=True)
    eng = graphed.llm_engine
    g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, 4, query_lens=(1,),
                       max_model_len=eng.max_model_len, max_blocks_per_seq=-(-eng.max_model_len // eng.config.block_size),
                       scratch_block=eng.scratch_block, capture_layers=None, mixed_sizes=[(1, 40)])
    g.capture(eager=True)
    eng.runner.graphs = g
    runner, mixed_in_split = eng.runner, []
    real_split = runner._split_mixed

    def watched_split(*args, **kw):
        before = runner.num_mixed_graph_steps
        out = real_split(*args, **kw)
        mixed_in_split.append(runner.num_mixed_graph_steps - before)
        return out

    runner._split_mixed = watched_split
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert runner.num_split_steps > 0
    assert sum(mixed_in_split) == 0


@pytest.mark.slow  # the Triton interpreter runs every attention call
def test_spec_engine_prefill_chunks_replay_mixed_graphs(graph_pair):
    """With speculation, the rows the speculative step's own graphs do not serve (prefill chunks of
    arriving requests) replay the target's mixed graphs, which capture the drafter's target layers
    for every row. Tokens equal the plain engine's (lossless either way), and the drafter's context
    cache, written from those layers, equals the one written after an eager prefill: a wrong row or
    layer there would only lower acceptance, which the tokens cannot show."""
    from adaspec.spec_decode.graphed_step import GraphedSpecStep

    prompts = prompt_ids(9)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(9)]
    kw = dict(attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
              skip_tokenizer_init=True)
    want = [o.outputs[0].token_ids for o in LLM(graph_pair[0], **kw).generate(prompts, params)]
    engines = {}
    for mixed in (False, True):
        llm = LLM(graph_pair[0], speculative_config={"method": "dspark", "model": graph_pair[1], "num_speculative_tokens": 3,
                                               "draft_sample_method": "greedy"}, **kw)
        eng = llm.llm_engine
        steps = GraphedSpecStep(eng.spec, eng, batch_sizes=[1, 2, 4])
        steps.capture(eager=True)
        eng.spec.use_graphs(steps)
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


def test_adaptive_plain_steps_replay_graphs_that_write_the_drafters_context(graph_pair, tmp_path, monkeypatch):
    """Adaptive speculation's plain async steps replay the target's decode and mixed graphs, which
    write the drafter's context inside the graph (engine/cuda_graphs.py, write_context), so no
    eager write follows them. With a drafter that attends to its context, every proposal (drafts
    and confidences) equals the synchronous engine's, whose plain steps write it eagerly: a graph
    that wrote nothing, or wrote the wrong rows, changes them."""
    prompts = prompt_ids(4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cfg = {"method": "dspark", "model": graph_pair[1], "num_speculative_tokens": 3, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path)}
    # the policy is scripted below: its tables are never read (profiling them in Triton's interpreter
    # would take most of this test's time)
    from adaspec.spec_decode import profiler
    from adaspec.spec_decode.cost_model import CostModel, CostTable

    monkeypatch.setattr(profiler, "build_cost_model", lambda *a, **kw: CostModel(CostTable([1, 64], [1.0, 2.0]),
                                                                                  CostTable([1, 8], [0.1, 0.2])))
    runs = []
    for graphed in (False, True):
        llm = LLM(graph_pair[0], speculative_config=cfg, attention_backend="triton", max_num_seqs=4, device="cpu",
                  max_num_batched_tokens=64, skip_tokenizer_init=True, async_scheduling=graphed)
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
        spec.policy.should_draft = lambda *a, e=eng, d=ahead: (e.stats.num_steps + d) % 4 == 0
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
