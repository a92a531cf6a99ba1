"""The CUDA-graph step's buffer logic (padding to captured sizes, packed verification rows, the
scratch block, per-step refresh of query starts, key lengths, block tables and slots), checked
on CPU: GraphedForward.capture(eager=True) replays by running the forward over the same static
buffers, with the Triton kernel in its interpreter. Greedy tokens must equal the plain eager
path's, for decode and for verification with mixed draft lengths, at batch sizes that pad. The
speculative engine's half is test_graph_buffers_spec.py."""
import pytest
from graph_buffers_common import _engine, _prompts, check_graph_buffers_match_eager, make_pair, needs_kernels

from adaspec import LLM, SamplingParams
from adaspec.engine.cuda_graphs import GraphedForward, capture_sizes, capture_time_split

pytestmark = needs_kernels
pair = pytest.fixture(scope="module", name="pair")(make_pair)


@pytest.fixture(scope="module")
def slots4_eager(pair):
    """The same 9 requests into an engine built for 12 whose scheduler runs 4 (so its graphs hold
    more rows than a step uses), eager (reference backend); computed once for both scheduling modes.
    max_tokens 3 + i: every arrival still meets decodes, and the tail shrinks one request per step."""
    prompts = _prompts(9)
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(9)]
    eager = _engine(pair, graphs=False, spec=False, backend="reference")
    eager.llm_engine.scheduler.max_num_seqs = 4
    return prompts, params, [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


@pytest.fixture(scope="module")
def arrivals_eager(pair):
    """9 requests arriving into 4 slots (steps with prefill chunks beside decodes): prompts, params,
    and the eager engine's tokens (reference backend), which the graphed engines of the tests below
    must equal."""
    prompts = _prompts(9)
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(9)]
    eager = LLM(pair[0], attention_backend="reference", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
                skip_tokenizer_init=True)
    return prompts, params, [o.outputs[0].token_ids for o in eager.generate(prompts, params)]


def test_capture_sizes():
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(1) == [1]


@pytest.mark.slow  # ~40 s: the Triton interpreter runs every attention call
def test_graph_buffers_match_eager_decode(pair):
    check_graph_buffers_match_eager(pair, spec=False)


@pytest.mark.slow  # the Triton interpreter runs every attention call
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_steps_split_into_graph_and_eager_forward(pair, slots4_eager, async_scheduling):
    """Requests arrive while others decode (4 slots, 9 prompts): a step with a prefill chunk runs its
    decode rows through the graph and the chunk eagerly, and the tokens equal the eager engine's.
    Async: the decode rows' inputs come from the previous step's tokens on the device, in both the
    graph's static buffers and the eager forward's, and the graph's host buffers alternate."""
    prompts, params, want = slots4_eager
    graphed = _engine(pair, graphs=True, spec=False, async_scheduling=async_scheduling)
    graphed.llm_engine.scheduler.max_num_seqs = 4
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert graphed.llm_engine.runner.num_split_steps > 0


def test_capture_time_split_separates_the_first_graph():
    assert capture_time_split([]) == "no graph captured"
    assert capture_time_split([1.5]) == "one graph, 1.50 s"
    assert capture_time_split([2.0, 0.1, 0.3, 0.12]) == "first graph 2.00 s, the others 120 ms each (median), 0.5 s in all"
    assert capture_time_split([2.0, 0.1, 0.2]) == "first graph 2.00 s, the others 150 ms each (median), 0.3 s in all"


def test_mixed_capture_sizes():
    from adaspec.engine.cuda_graphs import mixed_capture_sizes

    ts = (64, 192, 320, 448, 576, 704, 832, 1024, 1280, 1600, 1984, 2432, 3008, 3712, 4096)
    assert mixed_capture_sizes(256, 4096, 8192) == [(b, t) for b in (16, 256) for t in ts]
    assert mixed_capture_sizes(8, 100, 4096) == [(8, 64), (8, 100)]
    assert mixed_capture_sizes(16, 512, 16) == [(16, t) for t in (64, 192)]  # 320 / 16 > 16


@pytest.mark.parametrize("budget", [100, 512, 2048, 3000, 4096, 8192])
def test_every_step_size_has_a_mixed_graph_within_the_pad_limit(budget):
    """No gaps: a step of any size up to the token budget finds a graph that pick_mixed accepts
    (a speculative step's prefill chunk can be any size; one in a gap ran eagerly at ~25 ms)."""
    from adaspec.engine.cuda_graphs import mixed_capture_sizes, mixed_pad_limit

    ts = sorted({t for _, t in mixed_capture_sizes(256, budget, 1 << 20)})
    for n in range(1, budget + 1):
        t = next(x for x in ts if x >= n)
        assert t - n <= mixed_pad_limit(n), (n, t)


def test_mixed_graph_pick_refuses_heavy_padding(pair):
    eng = _engine(pair, graphs=False, spec=False).llm_engine
    g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, 256, query_lens=(1,),
                       max_model_len=eng.max_model_len, max_blocks_per_seq=4, scratch_block=eng.scratch_block,
                       capture_layers=None, mixed_sizes=[(16, 512), (256, 512), (256, 1024), (256, 2048)])
    assert g.pick_mixed(10, 400) == (16, 512)
    assert g.pick_mixed(17, 400) == (256, 512)
    assert g.pick_mixed(17, 900) == (256, 1024) and g.pick_mixed(17, 1000) == (256, 1024)
    assert g.pick_mixed(17, 520) is None  # 1024 would pad 504 tokens > max(128, 520 / 4)
    assert g.pick_mixed(17, 1100) is None  # 2048 would pad 948 tokens > 1100 / 4
    assert g.pick_mixed(17, 2100) is None  # beyond the largest


@pytest.mark.slow  # the Triton interpreter runs every attention call
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_graphs_run_decodes_and_prefill_chunks_in_one_replay(pair, arrivals_eager, async_scheduling):
    """Requests arrive while others decode: steps with prefill chunks (and prefill-only steps) replay
    a mixed graph, padded in requests and tokens, whose logits are each request's last row; the
    tokens equal the eager engine's."""
    prompts, params, want = arrivals_eager
    graphed = LLM(pair[0], attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
                  skip_tokenizer_init=True, async_scheduling=async_scheduling)
    eng = graphed.llm_engine
    g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, 4, query_lens=(1,),
                       max_model_len=eng.max_model_len, max_blocks_per_seq=-(-eng.max_model_len // eng.config.block_size),
                       scratch_block=eng.scratch_block, capture_layers=None, mixed_sizes=[(2, 16), (4, 40)])
    g.capture(eager=True)
    eng.runner.graphs = g
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert eng.runner.num_mixed_graph_steps > 3 and eng.runner.num_graph_steps > 3
    assert eng.runner.num_split_steps == 0  # every mixed step fitted a mixed graph


def test_capture_inputs_share_tokens_evenly(pair):
    """The dummy inputs every graph is captured with (decode, verify and mixed): t tokens over b
    requests, positions from 0 within each, K/V slots in the scratch block."""
    eng = _engine(pair, graphs=False, spec=False).llm_engine
    bs = eng.config.block_size
    g = GraphedForward(eng.model, eng.kv_caches, bs, eng.device, 4, query_lens=(1,), max_model_len=eng.max_model_len,
                       max_blocks_per_seq=4, scratch_block=eng.scratch_block, capture_layers=None, mixed_sizes=[(3, 8)])
    g._dummy_inputs(3, 8)
    assert g.query_start[:4].tolist() == [0, 3, 6, 8]
    assert g.positions[:8].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert g.kv_lens[:3].tolist() == [3, 3, 2]
    assert g.slot_mapping[:8].tolist() == [eng.scratch_block * bs + p for p in [0, 1, 2, 0, 1, 2, 0, 1]]
    g._dummy_inputs(4, 4)  # a decode graph: one token each
    assert g.query_start[:5].tolist() == [0, 1, 2, 3, 4] and g.positions[:4].tolist() == [0, 0, 0, 0]


@pytest.mark.slow  # the Triton interpreter runs every attention call
def test_split_steps_never_replay_a_mixed_graph(pair, arrivals_eager):
    """A step no mixed graph holds (here: more than one request) is split; its parts run as the decode
    graph and eagerly, never as a mixed graph (the prefill part alone would fit this one), whose replay could reuse the decode graph's output
    memory (one capture pool) before those outputs are read. Tokens equal the eager engine's."""
    prompts, params, want = arrivals_eager
    graphed = LLM(pair[0], attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=40, device="cpu",
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
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert runner.num_split_steps > 0
    assert sum(mixed_in_split) == 0


def test_verify_rows_without_a_graph_are_not_split(pair):
    """A speculative step's eager part can hold verify rows (every row wants logits) beside a
    prefill chunk; with only 1-token decode graphs captured, splitting would run the verify rows
    eagerly AND the chunk eagerly (a split part never replays a mixed graph): one eager forward
    instead. A 1-token decode row beside the chunk is still split."""
    from adaspec.engine.runner import ForwardItem

    eng = _engine(pair, graphs=False, spec=False).llm_engine
    g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, 4, query_lens=(1,),
                       max_model_len=eng.max_model_len, max_blocks_per_seq=4, scratch_block=eng.scratch_block,
                       capture_layers=None, batch_sizes=[1, 2])
    g.capture(eager=True)
    runner = eng.runner
    runner.graphs = g
    table = [eng.scratch_block]
    chunk = ForwardItem([3, 4, 5, 6, 7], 0, table, 1)
    runner.execute([ForwardItem([1, 2, 3, 4], 5, table, 4), chunk])  # a verify row: 4 query rows, 4 logits
    assert runner.num_split_steps == 0 and runner.num_eager_steps == 1
    runner.execute([ForwardItem([1], 5, table, 1), chunk])  # a decode row the graphs serve
    assert runner.num_split_steps == 1


