"""On CUDA the sampler and the device allocation must not synchronize with the host."""
import pytest
import torch

from adaspec.spec_decode.policy import allocate_torch, survival_torch
from adaspec.sample.random import SAMPLE, keyed_uniforms, sample_categorical
from adaspec.sample.rejection import rejection_sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_no_device_to_host_sync():
    dev = torch.device("cuda")
    N, K, V = 16, 7, 1000
    p = torch.softmax(torch.randn(N, K + 1, V, device=dev), -1)
    q = torch.softmax(torch.randn(N, K, V, device=dev), -1)
    x = torch.randint(0, V, (N, K), device=dev)
    conf = torch.rand(N, K, device=dev)
    greedy_host = torch.arange(N) % 3 == 0  # host copy: the engine knows it from the params
    seeds, anchors = torch.arange(N, device=dev) * 31, torch.full((N,), 100, device=dev)
    budget = torch.tensor(40, device=dev)  # a host scalar copied to the device: made before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lengths = allocate_torch(survival_torch(conf), budget)
        lengths2 = allocate_torch(survival_torch(conf), 40)
        out = rejection_sample(x, lengths, p, q, greedy_host, seeds, anchors)
        s = sample_categorical(p[:, 0], keyed_uniforms(seeds, anchors, SAMPLE))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.output_tokens.shape == (N, K + 1) and s.shape == (N,)
    assert torch.equal(lengths, lengths2) and int(lengths.sum()) == 40
