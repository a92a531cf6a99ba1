"""The sampler's Triton kernels (adaspec/sample/triton_sampling.py) against the torch functions
they replace on CUDA: processed_probs without filters and sample_categorical.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy underneath) on
small shapes; with CUDA the same cases run compiled. Several vocabulary sizes, so that rows span
one chunk, several chunks and a ragged last chunk (the kernels walk a row BLOCK entries at a time).
"""

import pytest
import torch

from adaspec.testing import triton_kernels_or_skip

triton = triton_kernels_or_skip()

from adaspec.sample import kernels  # noqa: E402
from adaspec.sample import triton_sampling as ts  # noqa: E402
from adaspec.sample.probs import processed_probs  # noqa: E402
from adaspec.sample.random import sample_categorical  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCABS = [7, 300, 5000]  # under one chunk, one ragged chunk, two chunks with a ragged tail


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 256 entries, so the interpreter's small rows still span several of them."""
    monkeypatch.setattr(ts, "_MAX_BLOCK", 256)


def _torch_probs(logits, temps, any_greedy=True):
    """processed_probs on the torch path (the kernels off: on CUDA it would dispatch to them)."""
    old = kernels.set_enabled(False)
    try:
        ones = torch.ones_like(temps)
        return processed_probs(logits, temps, ones, torch.zeros_like(temps, dtype=torch.long),
                               any_filter=False, any_greedy=any_greedy)
    finally:
        kernels.set_enabled(old)


def _torch_draw(weights, u):
    old = kernels.set_enabled(False)
    try:
        return sample_categorical(weights, u)
    finally:
        kernels.set_enabled(old)


def _case(n, V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V, generator=g) * scale).to(DEVICE)
    temps = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 0.0, 0.7, 1.3][:n] * (n // 8 + 1), device=DEVICE)[:n]
    u = torch.rand(n, generator=g).to(DEVICE)
    return logits, temps, u


@pytest.mark.parametrize("V", VOCABS)
def test_probs_match_processed_probs(V):
    logits, temps, _ = _case(8, V)
    got = ts.probs(logits, temps)
    want = _torch_probs(logits, temps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    greedy = temps <= 0
    assert torch.equal(got[greedy], want[greedy])  # exactly one-hot on the raw argmax


def test_probs_without_greedy_rows_keep_the_softmax_of_temperature_zero_rows():
    """any_greedy=False: a T = 0 row is softmax(logits) (processed_probs's own semantics)."""
    logits, temps, _ = _case(8, 300)
    got = ts.probs(logits, temps, greedy_rows=False)
    torch.testing.assert_close(got, _torch_probs(logits, temps, any_greedy=False), rtol=1e-5, atol=1e-7)
    assert (got[temps <= 0] < 1).all()


def test_probs_first_argmax_on_ties():
    logits = torch.zeros(2, 600, device=DEVICE)
    logits[0, [5, 300, 599]] = 4.0  # ties across chunks: the first wins, as torch.argmax
    logits[1, [450, 451]] = 2.0
    got = ts.probs(logits, torch.zeros(2, device=DEVICE))
    assert got[0].argmax().item() == 5 and got[0].sum().item() == 1.0
    assert got[1].argmax().item() == 450 and got[1].sum().item() == 1.0


def test_probs_gathers_rows_by_index_and_writes_into_a_strided_buffer():
    logits, temps, _ = _case(8, 300)
    index = torch.tensor([3, 3, 0, 7, 1], device=DEVICE)
    t_rows = temps[index]
    buf = torch.full((5, 2, 300), -1.0, device=DEVICE)
    got = ts.probs(logits, t_rows, index=index, out=buf[:, 1])
    assert got.data_ptr() == buf[:, 1].data_ptr()
    torch.testing.assert_close(buf[:, 1], _torch_probs(logits[index], t_rows), rtol=1e-5, atol=1e-7)
    assert (buf[:, 0] == -1).all()  # the other slot untouched
    # processed_probs's index on the torch path gives the same rows
    old = kernels.set_enabled(False)
    try:
        ones = torch.ones_like(t_rows)
        eager = processed_probs(logits, t_rows, ones, torch.zeros_like(index), any_filter=False, any_greedy=True,
                                index=index)
    finally:
        kernels.set_enabled(old)
    torch.testing.assert_close(eager, buf[:, 1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("V", VOCABS)
def test_probs_and_argmax_give_every_rows_first_raw_argmax(V):
    """The graphed verify step's greedy accept test reads this argmax: it must be torch's (first
    maximum of the raw logits, whatever the row's temperature), for the rows `index` picks."""
    logits, temps, _ = _case(8, V)
    logits[2, :] = 0.0
    logits[2, [V - 1, V // 2, 0]] = 5.0  # ties, across chunks where V spans several
    index = torch.tensor([2, 5, 5, 0, 7, 1], device=DEVICE)
    p, first = ts.probs_and_argmax(logits, temps[index], index=index)
    assert first.dtype == torch.int64
    assert torch.equal(first, logits[index].argmax(-1))
    assert first[0].item() == 0
    torch.testing.assert_close(p, _torch_probs(logits[index], temps[index]), rtol=1e-5, atol=1e-7)
    # the dispatching function gives the same on the torch path (CPU tensors, or the kernels off)
    from adaspec.sample.probs import probs_and_argmax
    old = kernels.set_enabled(False)
    try:
        p_t, first_t = probs_and_argmax(logits, temps[index], index=index)
    finally:
        kernels.set_enabled(old)
    assert torch.equal(first_t, first)
    torch.testing.assert_close(p_t, p, rtol=1e-5, atol=1e-7)


def test_out_of_the_wrong_shape_or_dtype_is_refused():
    logits, temps, _ = _case(4, 300)
    with pytest.raises(ValueError, match="float32"):
        ts.probs(logits, temps, out=torch.empty(4, 300, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[4, 300\]"):
        ts.probs(logits, temps, out=torch.empty(4, 299, device=DEVICE))


@pytest.mark.parametrize("V", VOCABS)
def test_draw_matches_sample_categorical(V):
    """Many rows, uniforms spread over [0, 1): the same index as the torch inverse CDF (a flip
    needs a uniform within float rounding of a CDF boundary: none in these draws)."""
    n = 64
    g = torch.Generator().manual_seed(V)
    w = torch.rand(n, V, generator=g) ** 4  # uneven weights
    w[torch.rand(n, V, generator=g) < 0.3] = 0.0  # and zeros, never drawn
    w = w.to(DEVICE)
    u = torch.rand(n, generator=g).to(DEVICE)
    got = ts.draw(w, u)
    assert torch.equal(got, _torch_draw(w, u))
    assert (w.gather(1, got[:, None]) > 0).all()


def test_draw_edges():
    """An all-zero row gives 0; u = 1 (outside the keyed uniforms' [0, 1), where u * total is the
    total itself) draws the entry where the CDF reaches its total, as the eager clamp to just below
    the total does, never a zero-weight entry past it; a single positive entry is always drawn."""
    V = 600
    w = torch.zeros(4, V, device=DEVICE)
    w[1, 10], w[1, 400] = 0.25, 0.5
    w[2, 599] = 3.0
    w[3, 0], w[3, 257] = 2.0, 1e-30  # the tiny tail does not move the float CDF past its total
    u = torch.tensor([0.5, 1.0, 0.0, 1.0 - 2**-24], device=DEVICE)
    got = ts.draw(w, u)
    assert got.tolist() == _torch_draw(w, u).tolist() == [0, 400, 599, 0]


@pytest.mark.parametrize("V", VOCABS)
def test_fused_draw_equals_draw_over_its_probs(V):
    """draw_from_logits draws what draw draws over the probabilities it wrote, bit for bit, and
    greedy rows draw their argmax."""
    logits, temps, u = _case(16, V, seed=V)
    tokens, p = ts.draw_from_logits(logits, temps, u)
    torch.testing.assert_close(p, _torch_probs(logits, temps), rtol=1e-5, atol=1e-7)
    assert torch.equal(tokens, ts.draw(p, u))
    assert torch.equal(tokens, _torch_draw(p, u))
    greedy = temps <= 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])


def test_draws_on_a_uniform_grid_hit_each_token_in_proportion():
    """The inverse-CDF property: with n uniforms on the grid (i + 1/2) / n, token v is drawn
    n * p(v) times, give or take one. A kernel off by one index, or scanning the wrong row, fails."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -30.0]], device=DEVICE)
    n = 500
    u = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).float().to(DEVICE)
    tokens, p = ts.draw_from_logits(logits.expand(n, -1), torch.full((n,), 0.8, device=DEVICE), u)
    counts = torch.bincount(tokens.cpu(), minlength=6).double()
    expected = p[0].double().cpu() / p[0].double().sum().cpu() * n
    assert (counts - expected).abs().max() <= 1.0, (counts, expected)


@pytest.mark.parametrize("V", VOCABS)
def test_sample_tokens_draw_as_the_fused_draw_and_give_greedy_rows_their_first_argmax(V):
    """sample_tokens: a sampled row draws what draw_from_logits draws (the same passes), a greedy
    row, which skips them, gets the first argmax of its raw logits (ties across chunks); the torch
    path of probs.sample_tokens gives the same tokens."""
    from adaspec.sample.probs import sample_tokens

    logits, temps, u = _case(16, V, seed=V + 1)
    assert temps[0] == 0
    logits[0, :] = 0.0
    logits[0, [V - 1, V // 2, 0]] = 5.0
    got = ts.sample_tokens(logits, temps, u)
    assert got.dtype == torch.int64
    assert torch.equal(got, ts.draw_from_logits(logits, temps, u)[0])
    greedy = temps <= 0
    assert torch.equal(got[greedy], logits.argmax(-1)[greedy]) and got[0].item() == 0
    old = kernels.set_enabled(False)
    try:
        assert torch.equal(sample_tokens(logits, temps, u), got)
    finally:
        kernels.set_enabled(old)
    # a batch of greedy rows only (the kernel's argmax pass alone), and of none
    zeros = torch.zeros_like(temps)
    assert torch.equal(ts.sample_tokens(logits, zeros, u), logits.argmax(-1))
    assert ts.sample_tokens(logits[:0], temps[:0], u[:0]).shape == (0,)
