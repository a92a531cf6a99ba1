"""SamplingBatch: built once per step; greedy drafting reuses it at temperature 0. processed_probs in
a batch that mixes filtered and unfiltered rows."""
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
