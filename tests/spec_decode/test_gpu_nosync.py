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
    # once before the check: compiled functions (adaspec/cuda_compiled.py, enabled by any engine
    # built earlier in this process) compile at their first call, as in an engine's warm-up
    rejection_sample(x, allocate_torch(survival_torch(conf), budget), p, q, greedy_host, seeds, anchors)
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


def test_the_graphed_steps_filter_and_logprobs_fix_up_does_not_sync():
    """graphed_extras.fix_up runs between the verify replay and the read back's copy: filtered
    probabilities, logprobs and the indexed writes into the read back must stay on the device."""
    from adaspec.sample.probs import logprobs_of, processed_probs

    dev = torch.device("cuda")
    X, K, V = 5, 7, 1000
    logits = torch.randn(X * (K + 1), V, device=dev)
    temp = torch.full((X * (K + 1),), 0.8, device=dev)
    top_p, top_k = torch.full_like(temp, 0.9), torch.full((X * (K + 1),), 20, device=dev)
    rows = torch.tensor([0, 2, 3, 7, 9], device=dev)
    readback = torch.zeros(16, 2 * K + 3, dtype=torch.int64, device=dev)
    cols = torch.arange(K + 1, device=dev).unsqueeze(0).expand(X, -1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        probs = processed_probs(logits, temp, top_p, top_k, any_filter=True, any_greedy=True)
        chosen = probs.argmax(-1)
        readback[rows[:, None], cols] = chosen.view(X, K + 1)
        readback[rows, K + 1] = chosen.view(X, K + 1)[:, 0]
        c_lp, top_ids, top_lp = logprobs_of(logits, chosen, 3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert top_ids.shape == (X * (K + 1), 3) and int(readback[9, 0]) == int(chosen[-(K + 1)])


def test_compiled_keyed_uniforms_equal_the_eager_ones_bit_for_bit():
    """use_compiled() swaps a torch.compile'd hash in for CUDA tensors (one kernel instead of ~50):
    every stream, with and without anchors, 1-D and 2-D positions, negative and 64-bit seeds, must
    give the eager function's float32 values exactly (seeded sampling must not change with it)."""
    from adaspec.sample import random as rnd

    rnd.compile_for_cuda()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-(1 << 62), 1 << 62, (61,), generator=g), torch.tensor([0, -1, (1 << 63) - 1])])
    pos1 = torch.randint(0, 1 << 20, (64,), generator=g)
    pos2 = torch.randint(0, 1 << 20, (64, 7), generator=g)
    anchors = torch.randint(0, 1 << 20, (64, 1), generator=g)
    cases = [(pos1, None), (pos2, None), (pos2, anchors), (pos1[:1], None), (pos2[:1], anchors[:1])]
    for stream in (rnd.SAMPLE, rnd.ACCEPT, rnd.DRAFT):
        for pos, anc in cases:
            s = seeds[: pos.shape[0]]
            want = rnd.keyed_uniforms_eager(s, pos, stream, anc)
            got = rnd.keyed_uniforms(s.to(dev), pos.to(dev), stream, None if anc is None else anc.to(dev))
            assert torch.equal(got.cpu(), want), (stream, tuple(pos.shape), anc is None)
    # slot-major, as the drafter draws its slots: seeds [1, R] against positions [k, R]
    got = rnd.keyed_uniforms(seeds[None, :64].to(dev), pos2.T.to(dev), rnd.DRAFT, anchors.T.to(dev))
    assert torch.equal(got.cpu(), rnd.keyed_uniforms_eager(seeds[:64], pos2, rnd.DRAFT, anchors).T)
    assert rnd._compiling and set(rnd._compiled) == {rnd.SAMPLE, rnd.ACCEPT, rnd.DRAFT}  # no fallback to eager


def test_a_hash_that_does_not_compile_falls_back_to_the_eager_one(monkeypatch):
    from adaspec.sample import random as rnd

    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(rnd, "_compiling", True)
    monkeypatch.setattr(rnd, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken)
    seeds, pos = torch.arange(4, device="cuda"), torch.arange(4, device="cuda") * 7
    assert torch.equal(rnd.keyed_uniforms(seeds, pos, rnd.SAMPLE).cpu(),
                       rnd.keyed_uniforms_eager(seeds.cpu(), pos.cpu(), rnd.SAMPLE, None))
    assert not rnd._compiling and rnd._compiled == {}
