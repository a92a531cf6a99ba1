"""SamplingBatch: built once per step; greedy drafting reuses it at temperature 0; the plain step
reuses it while its rows stay the same requests. processed_probs in a batch that mixes filtered
and unfiltered rows."""
import pytest
import torch

from adaspec.sample.batch import SamplingBatch
from adaspec.sample.probs import processed_probs
from adaspec.sampling_params import SamplingParams


def test_as_greedy_keeps_rows_and_zeroes_temperature():
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=3), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, top_k=5)]
    b = SamplingBatch.build(params, [11, 22, 33], "cpu")
    assert b.greedy == [False, True, False] and not b.all_greedy
    g = b.as_greedy()
    assert g.all_greedy and torch.equal(g.temperature, torch.zeros(3))
    assert torch.equal(g.seeds, b.seeds) and torch.equal(g.top_k, b.top_k) and g.logprobs == b.logprobs
    logits = torch.randn(3, 50)
    assert torch.equal(g.probs(logits).argmax(-1), logits.argmax(-1))  # one-hot on the argmax
    assert torch.equal(b.temperature, torch.tensor([0.7, 0.0, 1.3]))  # the original is untouched


def test_an_unfiltered_row_keeps_its_whole_distribution_beside_a_filtered_one():
    """Row 0 asks for nothing, row 1 for top_p = 0.5 (so the batch takes the sorting path): row 0
    must equal the plain softmax, tail included. Its float32 running mass reaches 1.0 long before
    its tail ends (one token at ~1 - 4e-15, 999 at ~4e-18 each), which once cut that tail."""
    V = 1000
    logits = torch.zeros(3, V)
    logits[:, 0] = 40.0
    logits[2] = torch.randn(V)
    top_p, top_k = torch.tensor([1.0, 0.5, 1.0]), torch.tensor([0, 0, V + 7])  # top_k >= V: no filter either
    probs = processed_probs(logits, torch.ones(3), top_p, top_k)
    for row in (0, 2):
        assert torch.equal(probs[row], torch.softmax(logits[row], -1))
    assert (probs[1] > 0).sum() == 1  # the filtered row keeps the one token that reaches 0.5


class _Seq:  # the two fields a SamplingBatch reads from a Sequence
    def __init__(self, temperature, seed):
        self.params, self.seed = SamplingParams(temperature=temperature), seed


def test_the_cache_hands_out_the_batch_again_only_for_the_same_requests_in_the_same_order():
    from adaspec.sample.batch import SamplingBatchCache

    cache = SamplingBatchCache()
    a, b, c = _Seq(0.7, 1), _Seq(1.3, 2), _Seq(0.5, 3)
    first = cache.get([a, b], "cpu")
    assert cache.get([a, b], "cpu") is first  # steady decoding: the same rows
    swapped = cache.get([b, a], "cpu")  # the same requests in another order: rebuilt, rows follow
    assert swapped is not first and torch.equal(swapped.temperature, torch.tensor([1.3, 0.7]))
    assert torch.equal(swapped.seeds, torch.tensor([2, 1]))
    # one request replaced by another of the same count (one finished, one joined): its own params
    replaced = cache.get([b, c], "cpu")
    assert torch.equal(replaced.temperature, torch.tensor([1.3, 0.5]))
    assert torch.equal(replaced.seeds, torch.tensor([2, 3]))
    # an equal-looking request is still another request (compared by identity, not by value)
    twin = _Seq(0.5, 3)
    assert cache.get([b, twin], "cpu") is not replaced
    assert cache.get([b], "cpu").temperature.tolist() == [pytest.approx(1.3)]  # fewer rows


def test_the_plain_step_samples_from_the_cached_batch_as_from_a_fresh_one(monkeypatch):
    """Seeded requests that join and leave a running batch, with different temperatures: each
    request's tokens equal its tokens alone (the cache must never hand a request another's
    parameters or seed), and steady steps really reuse the batch."""
    from adaspec import LLM

    llm = LLM("tiny", max_num_seqs=3)
    params = [SamplingParams(temperature=t, max_tokens=n, seed=50 + i, ignore_eos=True)
              for i, (t, n) in enumerate([(1.0, 6), (0.6, 14), (1.5, 9), (0.9, 12), (1.2, 5)])]
    prompts = ["def f(x):", "import re\n", "class A:", "x = [", "while "]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    built = []
    real = SamplingBatch.build
    monkeypatch.setattr(SamplingBatch, "build", classmethod(lambda cls, *a, **k: built.append(1) or real(*a, **k)))
    steps_before = llm.llm_engine.stats.num_steps
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == alone
    steps = llm.llm_engine.stats.num_steps - steps_before
    # one build per change of the running set (5 requests through 3 places), not one per step
    assert 0 < len(built) <= 8 < steps, (len(built), steps)


def test_the_triton_sampler_is_for_cuda_tensors_only():
    """CPU tensors always take the torch ops (the kernels run on CPU only under Triton's
    interpreter, in their own tests); switched off, CUDA takes them too, and results say which."""
    from adaspec.sample import kernels

    assert not kernels.use_triton(torch.zeros(2, 3))
    assert kernels.in_use("cpu") == "torch"
    old = kernels.set_enabled(False)
    try:
        assert kernels.in_use("cuda") == "torch"
    finally:
        assert kernels.set_enabled(old) is False


def test_a_missing_triton_leaves_the_torch_sampler_and_is_not_imported_again(monkeypatch):
    import sys

    from adaspec.sample import kernels

    monkeypatch.setitem(sys.modules, "adaspec.sample.triton_sampling", None)  # the import raises ImportError
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_missing", False)
    assert kernels.in_use("cuda") == "torch"
    assert kernels._missing
    monkeypatch.setattr(kernels, "triton_sampling", lambda: pytest.fail("imported again"))
    assert kernels.in_use("cuda") == "torch"
