"""The plain decode step's sampling graphs (engine/graphed_sampling.py): their computation equals the
eager sampler's row for row (greedy and sampled rows, seeds, positions), and an engine whose decode
graphs (replayed eagerly over their static buffers, Triton interpreter) sample through them gives a
seeded run's tokens exactly as the eager engine does, falling back to the eager sampler for steps
with a top-p row. On the GPU: tests/engine/test_cuda_graphs_gpu.py."""
import pytest
import torch
from graph_buffers_common import _engine, _prompts, make_pair, needs_kernels

from adaspec import SamplingParams
from adaspec.engine.graphed_sampling import GraphedDecodeSampler, sample_decode_rows
from adaspec.engine.llm_engine import LLMEngine
from adaspec.sample.batch import SamplingBatch

pair = pytest.fixture(scope="module", name="pair")(make_pair)


class _Seq:  # what the eager sampler reads from a Sequence: params, seed, len(token_ids), its logits rule
    def __init__(self, params, seed, position):
        self.params, self.seed, self.token_ids = params, seed, [0] * (position + 1)
        self.logits_rule = None


@pytest.mark.parametrize("trial", range(3))
def test_the_graphs_computation_is_the_eager_samplers(trial):
    g = torch.Generator().manual_seed(trial)
    n, V = 37, 300
    logits = 3 * torch.randn(n, V, generator=g)
    temps = [0.0 if i % 4 == 0 else float(t) for i, t in enumerate(torch.rand(n, generator=g) * 1.5 + 0.1)]
    seeds = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g).tolist()
    positions = torch.randint(0, 5000, (n,), generator=g)
    seqs = [_Seq(SamplingParams(temperature=t), s, int(p)) for t, s, p in zip(temps, seeds, positions)]
    batch = SamplingBatch.build([s.params for s in seqs], seeds, "cpu")
    want = LLMEngine._sample_on_device(logits, seqs, batch)
    got = sample_decode_rows(logits, batch.temperature, batch.seeds, positions)
    assert torch.equal(got, want)
    assert torch.equal(got[::4], logits[::4].argmax(-1))  # greedy rows
    # and the draws do depend on the position and the seed (a sampler that ignored them would pass above
    # only if the eager one did too, so check they matter)
    assert not torch.equal(sample_decode_rows(logits, batch.temperature, batch.seeds, positions + 1), got)
    assert not torch.equal(sample_decode_rows(logits, batch.temperature, batch.seeds + 1, positions), got)


def _with_sampler(llm) -> GraphedDecodeSampler:
    eng = llm.llm_engine
    sampler = GraphedDecodeSampler(eng.runner.graphs)
    sampler.capture(eager=True)
    eng._decode_sampler = sampler
    return sampler


@needs_kernels
@pytest.mark.slow  # the Triton interpreter runs every attention call
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_seeded_run_samples_in_the_decode_graphs_as_the_eager_engine_does(pair, async_scheduling):
    """Seeded requests of several temperatures (one greedy) finishing at different steps (batch sizes
    that pad: 6 -> 8, 3 -> 4), then the same with one top-p request, whose steps sample eagerly."""
    prompts = _prompts(6)
    params = [SamplingParams(temperature=(0.0, 0.6, 1.0, 1.4)[i % 4], seed=100 + i, max_tokens=3 + i,
                             ignore_eos=True) for i in range(6)]
    eager = _engine(pair, graphs=False, spec=False, backend="reference")
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphed = _engine(pair, graphs=True, spec=False, async_scheduling=async_scheduling)
    sampler = _with_sampler(graphed)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    runner = graphed.llm_engine.runner
    assert sampler.num_replays == runner.num_graph_steps > 3  # every decode step sampled in its graph

    filtered = params[:5] + [SamplingParams(temperature=1.0, top_p=0.8, seed=105, max_tokens=4, ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, filtered)]
    before, steps_before = sampler.num_replays, runner.num_graph_steps
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, filtered)]
    assert got == want
    graph_steps = runner.num_graph_steps - steps_before
    # the top-p request's steps (its 3 decodes) sampled eagerly; the steps after it finished, in the graphs
    assert 0 < sampler.num_replays - before <= graph_steps - 3
