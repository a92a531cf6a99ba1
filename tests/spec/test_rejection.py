"""Rejection sampler: greedy exactness, statistical losslessness, and that the test can fail."""
import numpy as np
import pytest
import torch

from adaspec.spec.rejection import rejection_sample, sample_rows

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
    out, nacc, nemit = rejection_sample(x, lv, p, q, greedy)
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
                                    target_argmax=torch.tensor([[1, 2]]))
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


def test_rows_with_generators_ignore_their_neighbours():
    V, K = 6, 3
    base = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, K + 1, V, generator=base), -1)
    q = torch.softmax(torch.randn(4, K, V, generator=base), -1)
    x = torch.randint(0, V, (4, K), generator=base)
    lv = torch.tensor([3, 2, 3, 1])
    greedy = torch.tensor([False, True, False, False])

    def run(rows, seed_rows):
        gens = [torch.Generator().manual_seed(100 + r) if r in seed_rows else None for r in rows]
        return rejection_sample(x[rows], lv[rows], p[rows], q[rows], greedy[rows], generators=gens)

    full = run([0, 1, 2, 3], {0, 2, 3})
    for r in (0, 2, 3):
        alone = run([r], {r})
        assert alone.output_tokens[0].tolist() == full.output_tokens[[0, 1, 2, 3].index(r)].tolist()


def test_bonus_only_and_zero_residual_fallback():
    p = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    out, nacc, nemit = rejection_sample(torch.tensor([[0]]), torch.tensor([0]), p, None, torch.tensor([False]))
    assert out.tolist() == [[2, -1]] and nacc.tolist() == [0] and nemit.tolist() == [1]
    # unnormalized p = 0.5 q: max(p - q, 0) is all zero, the row falls back to p
    q = torch.tensor([[[0.2, 0.8, 0.0]]])
    p2 = torch.cat([0.5 * q, torch.tensor([[[0.0, 0.0, 1.0]]])], 1)
    outs = [rejection_sample(torch.tensor([[1]]), torch.tensor([1]), p2, q, torch.tensor([False])).output_tokens
            for _ in range(50)]
    assert all(o[0, 0] in (0, 1) for o in outs)
    # K = 0: just a sample from p_0
    out0 = rejection_sample(torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]), p[:, :1], None, torch.tensor([False]))
    assert out0.output_tokens.tolist() == [[2]]


def test_sample_rows_distribution_and_generators():
    torch.manual_seed(0)
    probs = torch.tensor([0.1, 0.0, 0.3, 0.6]).expand(N_SAMPLES, 4).contiguous()
    s = sample_rows(probs)
    assert (s != 1).all()
    exact = {(0,): 0.1, (2,): 0.3, (3,): 0.6}
    assert chi_square_pvalue(s.numpy()[:, None], exact) > 1e-3
    gens = lambda: [torch.Generator().manual_seed(i) if i % 3 else None for i in range(9)]  # noqa: E731
    a, b = sample_rows(probs[:9], gens()), sample_rows(probs[:9], gens())
    assert a[1::3].tolist() == b[1::3].tolist() and a[2::3].tolist() == b[2::3].tolist()
