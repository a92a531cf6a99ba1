"""Rejection sampler: greedy exactness, statistical losslessness, and that the test can fail."""
import numpy as np
import pytest
import torch

from adaspec.sample.random import SAMPLE, keyed_uniforms, sample_categorical
from adaspec.sample.rejection import rejection_sample

from .lossless_harness import chi_square_pvalue, lossless_pvalue, marginal
from .micro import MicroSpec, broken_sampler

N_SAMPLES = 20000

# Markov target over V=5 with a zero entry (as after top-k), a poor drafter that favours
# what the target dislikes, and confidences that depend on the previous token.
P = np.array([[0.50, 0.20, 0.15, 0.10, 0.05],
              [0.10, 0.60, 0.00, 0.20, 0.10],
              [0.25, 0.25, 0.25, 0.15, 0.10],
              [0.05, 0.05, 0.30, 0.30, 0.30],
              [0.40, 0.00, 0.10, 0.10, 0.40]])
Q = np.roll(P, 2, axis=1) * 0.7 + 0.06  # rows sum to 1; mass in the wrong places
C = [0.9, 0.6, 0.3, 0.8, 0.5]


def micro(k=3):
    return MicroSpec(P, Q, C, anchor=0, k=k)


def full_k(k):
    return lambda step, conf: np.full(conf.shape[0], k)


def test_micro_setup_is_a_poor_drafter():
    assert np.allclose(Q.sum(1), 1) and np.abs(P - Q).sum(1).min() > 0.4


def test_greedy_rows_match_reference_loop():
    g = torch.Generator().manual_seed(1)
    N, K, V = 400, 4, 7
    p = torch.softmax(torch.randn(N, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(N, K, V, generator=g), -1)
    am = p.argmax(-1)
    # drafts equal to the target argmax most of the time, so long accepts happen
    x = torch.where(torch.rand(N, K, generator=g) < 0.7, am[:, :K], torch.randint(0, V, (N, K), generator=g))
    lv = torch.randint(0, K + 1, (N,), generator=g)
    greedy = torch.rand(N, generator=g) < 0.5
    out, nacc, nemit = rejection_sample(x, lv, p, q, greedy, torch.arange(N), torch.zeros(N, dtype=torch.long))
    for n in np.flatnonzero(greedy.numpy()):
        ref = []
        for j in range(int(lv[n])):
            if int(x[n, j]) != int(am[n, j]):
                break
            ref.append(int(x[n, j]))
        ref.append(int(am[n, len(ref)]))
        assert out[n, : len(ref)].tolist() == ref and (out[n, len(ref):] == -1).all()
        assert int(nacc[n]) == len(ref) - 1 and int(nemit[n]) == len(ref)
    # probabilistic rows too: shape invariants
    assert ((nacc >= 0) & (nacc <= lv)).all() and (nemit == nacc + 1).all()
    accepted_prefix = torch.arange(K + 1)[None, :] < nacc[:, None]
    assert (out[:, :K][accepted_prefix[:, :K]] == x[accepted_prefix[:, :K]]).all()


def test_target_argmax_override_is_used_for_greedy():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]])  # a tie in probs
    out, nacc, _ = rejection_sample(torch.tensor([[1]]), torch.tensor([1]), p, None, torch.tensor([True]),
                                    torch.tensor([0]), torch.tensor([0]), target_argmax=torch.tensor([[1, 2]]))
    assert out.tolist() == [[1, 2]] and nacc.tolist() == [1]


@pytest.mark.parametrize("k", [1, 3])
def test_lossless_fixed_k_first_token_and_pairs(k):
    torch.manual_seed(10 + k)
    m = micro(k)
    samples = m.generate(N_SAMPLES, 2, full_k(k))
    exact = m.exact(2)
    assert chi_square_pvalue(samples[:, :1], marginal(exact, 1)) > 1e-3
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_lossless_with_random_lengths_and_three_tokens():
    torch.manual_seed(3)
    m = micro(3)
    rng = np.random.default_rng(0)  # lengths independent of the drafts: allowed
    p = lossless_pvalue(lambda n: m.generate(n, 3, lambda s, c: rng.integers(0, 4, c.shape[0])), m.exact(3), N_SAMPLES)
    assert p > 1e-3


def test_lossless_deterministic_drafts():
    torch.manual_seed(4)
    m = micro(3)
    samples = m.generate(N_SAMPLES, 2, full_k(3), deterministic_draft=True)
    assert chi_square_pvalue(samples, m.exact(2)) > 1e-3


@pytest.mark.parametrize("variant", ["accept_all", "residual_from_p"])
def test_broken_samplers_fail_the_same_test(variant):
    torch.manual_seed(5)
    m = micro(3)
    samples = m.generate(N_SAMPLES, 2, full_k(3), sampler=broken_sampler(variant))
    assert chi_square_pvalue(samples, m.exact(2)) < 1e-6


def test_rows_ignore_their_neighbours():
    """A row's result is a function of its own inputs (seed, anchor, p, q): the batch it sits in
    does not matter, and the same seed at another anchor position draws other randoms."""
    V, K, N = 6, 3, 64
    base = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(N, K + 1, V, generator=base), -1)
    q = torch.softmax(torch.randn(N, K, V, generator=base), -1)
    x = torch.randint(0, V, (N, K), generator=base)
    lv = torch.randint(0, K + 1, (N,), generator=base)
    greedy = torch.rand(N, generator=base) < 0.25
    seeds, anchors = torch.arange(N) * 7919, torch.randint(0, 500, (N,), generator=base)

    def run(rows, anchor_shift=0):
        return rejection_sample(x[rows], lv[rows], p[rows], q[rows], greedy[rows], seeds[rows],
                                anchors[rows] + anchor_shift).output_tokens

    full = run(list(range(N)))
    for r in range(N):
        assert run([r]).tolist() == full[r:r + 1].tolist()
    shuffled = torch.randperm(N, generator=base)
    assert torch.equal(run(shuffled.tolist()), full[shuffled])
    assert not torch.equal(run(list(range(N)), anchor_shift=1), full)  # other positions, other randoms


def test_bonus_only_and_zero_residual_fallback():
    p = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    z = torch.tensor([0])
    out, nacc, nemit = rejection_sample(torch.tensor([[0]]), torch.tensor([0]), p, None, torch.tensor([False]), z, z)
    assert out.tolist() == [[2, -1]] and nacc.tolist() == [0] and nemit.tolist() == [1]
    # unnormalized p = 0.5 q: max(p - q, 0) is all zero, the row falls back to p
    q = torch.tensor([[[0.2, 0.8, 0.0]]])
    p2 = torch.cat([0.5 * q, torch.tensor([[[0.0, 0.0, 1.0]]])], 1)
    outs = [rejection_sample(torch.tensor([[1]]), torch.tensor([1]), p2, q, torch.tensor([False]), torch.tensor([s]),
                             z).output_tokens for s in range(50)]
    assert all(o[0, 0] in (0, 1) for o in outs)
    # K = 0: just a sample from p_0
    out0 = rejection_sample(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), p[:, :1], None, torch.tensor([False]),
                            z, z)
    assert out0.output_tokens.tolist() == [[2]]


def test_keyed_categorical_distribution_and_reproducibility():
    probs = torch.tensor([0.1, 0.0, 0.3, 0.6]).expand(N_SAMPLES, 4).contiguous()
    seeds, positions = torch.arange(N_SAMPLES) * 104729, torch.full((N_SAMPLES,), 17)
    s = sample_categorical(probs, keyed_uniforms(seeds, positions, SAMPLE))
    assert (s != 1).all()
    exact = {(0,): 0.1, (2,): 0.3, (3,): 0.6}
    assert chi_square_pvalue(s.numpy()[:, None], exact) > 1e-3
    # one seed along positions is a fresh draw per position too
    along = sample_categorical(probs, keyed_uniforms(torch.tensor([5]), torch.arange(N_SAMPLES)[None], SAMPLE)[0])
    assert chi_square_pvalue(along.numpy()[:, None], exact) > 1e-3
    again = sample_categorical(probs[:9], keyed_uniforms(seeds[:9], positions[:9], SAMPLE))
    assert again.tolist() == s[:9].tolist()


def test_keyed_uniforms_are_uniform_and_independent_across_streams():
    n = 200_000
    seeds, pos = torch.arange(n) // 100, torch.arange(n) % 100
    u = [keyed_uniforms(seeds, pos, stream).double().numpy() for stream in (1, 2, 3)]
    for x in u:
        hist = np.histogram(x, bins=20, range=(0, 1))[0]
        assert chi_square_pvalue(np.repeat(np.arange(20), hist)[:, None], {(b,): 0.05 for b in range(20)}) > 1e-3
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert abs(np.corrcoef(u[a], u[b])[0, 1]) < 0.01


def test_sample_categorical_edges():
    assert sample_categorical(torch.zeros(2, 4), torch.tensor([0.5, 0.99])).tolist() == [0, 0]
    # u at the very top never lands on the zero-weight tail
    w = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    assert sample_categorical(w, torch.tensor([1.0 - 2 ** -24])).tolist() == [1]
    assert sample_categorical(w, torch.tensor([0.0])).tolist() == [1]


@pytest.mark.parametrize("K, with_q, given_argmax", [(7, True, True), (3, False, False), (0, True, True), (4, True, False)])
def test_the_fused_and_the_plain_assembly_agree(K, with_q, given_argmax):
    """fused=True (the graphed step: its halves compiled on CUDA, the keyed hash inside them) and
    the plain assembly (eager paths) are two arrangements of one computation: every output equal,
    greedy and sampled rows, padding rows verifying nothing, with and without q and an argmax."""
    g = torch.Generator().manual_seed(K * 10 + with_q)
    N, V = 12, 50
    p = torch.softmax(2 * torch.randn(N, K + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(N, K, V, generator=g), -1) if with_q else None
    x = torch.randint(0, V, (N, K), generator=g)
    if K:
        x[:, 0] = p[:, 0].argmax(-1)
    nv = torch.randint(0, K + 1, (N,), generator=g)
    nv[0] = 0
    greedy = torch.arange(N) % 4 == 1
    seeds, anchors = torch.arange(N) * 977 + 5, torch.randint(3, 300, (N,), generator=g)
    argmax = p.argmax(-1) if given_argmax else None
    plain = rejection_sample(x, nv, p, q, greedy, seeds, anchors, target_argmax=argmax)
    fused = rejection_sample(x, nv, p, q, greedy, seeds, anchors, target_argmax=argmax, fused=True)
    for a, b in zip(plain, fused):
        assert torch.equal(a, b)
    assert bool((plain.num_emitted == plain.num_accepted + 1).all()) and bool((plain.num_accepted <= nv).all())
