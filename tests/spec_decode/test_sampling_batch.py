"""SamplingBatch: built once per step; greedy drafting reuses it at temperature 0."""
import torch

from adaspec.sample.batch import SamplingBatch
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
