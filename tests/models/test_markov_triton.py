"""The fused Markov slot (adaspec/models/markov_triton.py) against the drafter's torch loop: the
slot's logits (U_j + B(prev) + rules' bias), its draft distribution q, greedy tokens, and the
draw, which must be the inverse CDF of the q it wrote with the slot's uniform (that is what makes
verification exact). Without CUDA the kernels run in Triton's interpreter on small shapes, with
small chunks so that rows span several of them; with CUDA the same cases run compiled."""

import pytest
import torch

from adaspec.testing import triton_kernels_or_skip

triton = triton_kernels_or_skip()

from adaspec.models import markov_loop_triton as ml  # noqa: E402
from adaspec.models import markov_triton as mt  # noqa: E402
from adaspec.sample import kernels  # noqa: E402
from adaspec.sample.batch import SamplingBatch  # noqa: E402
from adaspec.sample.probs import sample_from_logits  # noqa: E402
from adaspec.sampling_params import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def small_chunks(request, monkeypatch):
    """Chunks of 32 (logits) and 64 (probs) entries: the interpreter's small rows span several.
    Tests marked `real_chunks` keep the module's own sizes."""
    if "real_chunks" not in request.keywords:
        monkeypatch.setattr(mt, "BLOCK_V", 32)
        monkeypatch.setattr(mt, "block_q", lambda V: 64)


def _weights(V, rank, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(V, rank, generator=g) * 0.5
    w2 = torch.randn(V, rank, generator=g) * 0.5
    return w1.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _reference(base, prev, w1, w2, temps, u, bias=None):
    """The torch loop's slot: U + W2 W1[prev] (+ bias), then processed probs and the draw, with the
    Triton sampler switched off (the semantics the kernels keep)."""
    lg = base.float() + torch.nn.functional.linear(w1[prev], w2)
    if bias is not None:
        lg = lg + bias
    old = kernels.set_enabled(False)
    try:
        n = lg.shape[0]
        tok, q = sample_from_logits(lg, temps, torch.ones(n, device=DEVICE), torch.zeros(n, dtype=torch.long,
                                    device=DEVICE), u, any_filter=False, any_greedy=True)
    finally:
        kernels.set_enabled(old)
    return lg, q, tok


def _inverse_cdf(q, u):
    """In float64: the first index whose running sum exceeds u * total, and how close u * total
    lies to the nearest boundary (a float32 draw may differ from this one only that close)."""
    cs = q.double().cumsum(-1)
    target = u.double() * cs[:, -1]
    idx = (cs > target[:, None]).int().argmax(-1)
    margin = (cs - target[:, None]).abs().min(-1).values
    return idx, margin


IMPLS = {"slot": "markov_triton.markov_slot", "loop": "markov_loop_triton.markov_loop, one slot",
         "loop-subtiles": "markov_loop_triton.markov_loop, one slot, programs of 4 sub-tiles"}
_impl = "slot"


@pytest.fixture(params=list(IMPLS))
def impl(request, monkeypatch):
    """A slot's kernels: markov_triton's, or markov_loop_triton's loop over one slot (its finishing
    kernel draws and writes q), with programs of one sub-tile or, chunks capped at 2 a row, of 4."""
    global _impl
    _impl = request.param
    if request.param == "loop-subtiles":
        monkeypatch.setattr(ml, "MAX_CHUNKS", 2)
    yield request.param
    _impl = "slot"


def _chunk_size(V: int) -> int:
    """Entries per chunk of the draw's walk: the probs programs' (slot), or a loop program's."""
    if _impl == "slot":
        return mt.block_q(V)
    subs, _ = ml.chunking(V)
    return subs * mt.BLOCK_V


def _run(base, prev, w1, w2, temps, u, bias=None, greedy=False):
    R, V = base.shape
    tokens = torch.full((R, 3), -1, dtype=torch.long, device=DEVICE)  # a strided column, like tokens[:, j]
    lg = torch.empty(R, V, device=DEVICE)
    q = None if greedy else torch.full((R, 2, V), -1.0, device=DEVICE)  # a slot of a strided buffer
    if _impl == "slot":
        mt.markov_slot(base, prev, w1, w2, temps, tokens[:, 1], lg, q_out=None if greedy else q[:, 1],
                       uniforms=None if greedy else u, bias=bias)
    else:
        ml.markov_loop(base[:, None], prev, w1, w2, temps, tokens[:, 1:2], lg[:, None],
                       q_out=None if greedy else q[:, 1:2], uniforms=None if greedy else u[None],
                       bias_of=None if bias is None else (lambda j: bias))
    assert (tokens[:, [0, 2]] == -1).all()
    if q is not None:
        assert (q[:, 0] == -1).all()
    return tokens[:, 1], lg, None if q is None else q[:, 1]


@pytest.mark.parametrize("R,V,rank", [(1, 200, 8), (5, 257, 16), (20, 130, 24)])
def test_a_sampled_slot_is_the_torch_loops_slot(R, V, rank, impl):
    """Rows with T in {0, 0.5, 1, 2}, more rows than one logits program holds (20 > 16), ragged
    last chunks, a rank padded up to the dot's 16: logits and q as torch's, greedy rows the
    one-hot of the first argmax, every draw the inverse CDF of the q written."""
    g = torch.Generator().manual_seed(R * V)
    w1, w2 = _weights(V, rank, seed=rank)
    base = (torch.randn(R, V, generator=g) * 2).to(DEVICE)
    prev = torch.randint(0, V, (R,), generator=g).to(DEVICE)
    temps = torch.tensor([0.0, 1.0, 0.5, 2.0] * 5, device=DEVICE)[:R]
    u = torch.rand(R, generator=g).to(DEVICE)
    tok, lg, q = _run(base, prev, w1, w2, temps, u)
    want_lg, want_q, want_tok = _reference(base, prev, w1, w2, temps, u)
    torch.testing.assert_close(lg, want_lg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-7)
    greedy = temps <= 0
    assert torch.equal(q[greedy], want_q[greedy])
    assert torch.equal(tok[greedy], want_lg[greedy].argmax(-1))
    idx, margin = _inverse_cdf(q, u)
    flips = (tok != idx) & (margin > 1e-5)
    assert not flips[~greedy].any(), (tok, idx, margin)
    assert torch.equal(tok, want_tok)  # and torch's own draw, no uniform near a boundary here


def test_draws_follow_q(impl):
    """The same row 600 times with uniforms on a grid: the drawn tokens' frequencies are q's
    (each token gets the uniforms of its CDF interval: exact up to the grid's step)."""
    V, R = 40, 600
    w1, w2 = _weights(V, 16, seed=3)
    base = (torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 1.5).to(DEVICE).expand(R, V).contiguous()
    prev = torch.full((R,), 7, device=DEVICE)
    temps = torch.ones(R, device=DEVICE)
    u = (torch.arange(R, dtype=torch.float32, device=DEVICE) + 0.5) / R
    tok, _, q = _run(base, prev, w1, w2, temps, u)
    freq = torch.bincount(tok, minlength=V).float() / R
    assert (freq - q[0]).abs().max().item() <= 1.0 / R + 1e-6


def test_greedy_slots_take_the_first_argmax_without_q(impl):
    """Every row greedy: the token is the first argmax of the slot's logits (ties across chunks too)."""
    V, R = 150, 18
    w1, w2 = _weights(V, 16, seed=5)
    base = torch.randn(R, V, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    prev = torch.arange(R, device=DEVICE)
    w1[0] = 0.0  # row 0 (prev 0) gets no bias: its logits are its base, three equal maxima in different chunks
    base[0] = 0.0
    base[0, [40, 100, 149]] = 3.0
    temps = torch.zeros(R, device=DEVICE)
    tok, lg, _ = _run(base, prev, w1, w2, temps, None, greedy=True)
    torch.testing.assert_close(lg, base + torch.nn.functional.linear(w1[prev], w2), rtol=1e-5, atol=1e-5)
    assert tok[0].item() == 40
    assert torch.equal(tok, lg.argmax(-1))


def test_the_rules_bias_is_added_and_masked_tokens_are_never_drawn(impl):
    V, R = 100, 6
    w1, w2 = _weights(V, 16, seed=7)
    g = torch.Generator().manual_seed(4)
    base = torch.randn(R, V, generator=g).to(DEVICE)
    prev = torch.randint(0, V, (R,), generator=g).to(DEVICE)
    bias = torch.randn(R, 2, V, generator=g).to(DEVICE)
    bias[:, 1, ::2] = float("-inf")  # the slot's rules allow odd tokens only
    temps = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.7, 0.0], device=DEVICE)
    u = torch.rand(R, generator=g).to(DEVICE)
    tok, lg, q = _run(base, prev, w1, w2, temps, u, bias=bias[:, 1])
    want_lg, want_q, want_tok = _reference(base, prev, w1, w2, temps, u, bias=bias[:, 1])
    torch.testing.assert_close(lg, want_lg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-7)
    assert (tok % 2 == 1).all() and (q[:, ::2] == 0).all()
    assert torch.equal(tok, want_tok)


def test_bad_arguments_are_refused():
    V = 50
    w1, w2 = _weights(V, 16)
    base = torch.randn(2, V, device=DEVICE)
    prev = torch.zeros(2, dtype=torch.long, device=DEVICE)
    tok = torch.empty(2, dtype=torch.long, device=DEVICE)
    lg = torch.empty(2, V, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="q_out and uniforms"):
        mt.markov_slot(base, prev, w1, w2, ones, tok, lg, q_out=torch.empty(2, V, device=DEVICE))
    with pytest.raises(ValueError, match="a draw needs logits_out"):
        mt.markov_slot(base, prev, w1, w2, ones, tok, None, q_out=torch.empty(2, V, device=DEVICE), uniforms=ones)
    with pytest.raises(ValueError, match="contiguous rows"):
        mt.markov_slot(base.t().contiguous().t(), prev, w1, w2, ones, tok, lg)
    with pytest.raises(ValueError, match=r"q_out must be torch.float32 \[2, 50\]"):  # a bf16 q would break the draw
        mt.markov_slot(base, prev, w1, w2, ones, tok, lg, q_out=torch.empty(2, V, dtype=torch.bfloat16, device=DEVICE),
                       uniforms=ones)
    with pytest.raises(ValueError, match="prev must be torch.int64"):
        mt.markov_slot(base, prev.int(), w1, w2, ones, tok, lg)
    with pytest.raises(ValueError, match=r"w1 \[V, r\]"):
        mt.markov_slot(base, prev, w1, w2[:10], ones, tok, lg)
    big1, big2 = _weights(V, mt.MAX_RANK + 1)
    with pytest.raises(ValueError, match="rank of at most"):
        mt.markov_slot(base, prev, big1, big2, ones, tok, lg)


def test_the_loops_bad_arguments_are_refused_and_no_slots_is_nothing_to_do():
    V, R, w = 50, 2, 3
    w1, w2 = _weights(V, 16)
    base = torch.randn(R, w, V, device=DEVICE)
    anchors = torch.zeros(R, dtype=torch.long, device=DEVICE)
    tok = torch.empty(R, w, dtype=torch.long, device=DEVICE)
    ones = torch.ones(R, device=DEVICE)
    with pytest.raises(ValueError, match="q_out and uniforms"):
        ml.markov_loop(base, anchors, w1, w2, ones, tok, q_out=torch.empty(R, w, V, device=DEVICE))
    with pytest.raises(ValueError, match=r"uniforms must be torch.float32 \[3, 2\]"):  # slot-major
        ml.markov_loop(base, anchors, w1, w2, ones, tok, q_out=torch.empty(R, w, V, device=DEVICE),
                       uniforms=torch.rand(R, w, device=DEVICE))
    with pytest.raises(ValueError, match="tokens_out must be torch.int64"):
        ml.markov_loop(base, anchors, w1, w2, ones, tok[:, :2])
    with pytest.raises(ValueError, match="slot 1's bias must be torch.float32"):
        ml.markov_loop(base, anchors, w1, w2, ones, tok, bias_of=lambda j: torch.zeros(R, V + (j == 1), device=DEVICE))
    with pytest.raises(ValueError, match="contiguous rows"):
        ml.markov_loop(base.transpose(0, 2).contiguous().transpose(0, 2), anchors, w1, w2, ones, tok)
    ml.markov_loop(base[:, :0], anchors, w1, w2, ones, tok[:, :0])  # no slots: nothing to launch


def _tiny_drafter(dtype=torch.float32):
    from adaspec.models.config import ModelConfig
    from adaspec.models.drafter import DrafterConfig, DSparkDrafter

    target = ModelConfig(architecture="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(target, mask_token_id=299, block_size=4, markov_rank=8, target_layer_ids=[0, 1])
    return DSparkDrafter(cfg).to(DEVICE, dtype).eval()


@pytest.mark.parametrize("loop_rows", ["32", "0"])
@pytest.mark.parametrize("all_greedy", [True, False])
def test_the_drafters_fused_loop_is_its_torch_loop(all_greedy, loop_rows, monkeypatch):
    """DSparkDrafter's fused loop and its torch loop over the same block: the same tokens, q and
    logits, with a (first slot, other slots) rules' bias, for greedy and mixed sampled rows; the
    fused loop in one kernel a slot (markov_loop_triton, 5 rows <= 32) and in markov_triton's slots."""
    monkeypatch.setenv("ADASPEC_MARKOV_LOOP_ROWS", loop_rows)
    model = _tiny_drafter()
    R, k, V = 5, 4, 300
    g = torch.Generator().manual_seed(9)
    base = (torch.randn(R, k, V, generator=g) * 2).to(DEVICE)
    anchor_ids = torch.randint(0, V, (R,), generator=g).to(DEVICE)
    params = [SamplingParams(temperature=0.0 if all_greedy or i == 1 else 0.8, seed=i) for i in range(R)]
    sampling = SamplingBatch.build(params, list(range(R)), DEVICE)
    bias = torch.zeros(R, 2, V, device=DEVICE)
    bias[:, 0, :100] = float("-inf")
    bias[:, 1] = torch.randn(R, V, generator=g).to(DEVICE)
    u = torch.rand(k, R, generator=g).to(DEVICE)
    outs = []
    for fused in (False, True):
        q = None if all_greedy else torch.empty(R, k, V, device=DEVICE)
        if fused:
            tok, lg = model._markov_loop_fused(mt, base, anchor_ids, sampling, q, None if all_greedy else u, bias, True)
        else:
            old = kernels.set_enabled(False)
            try:
                tok, lg = model._markov_loop(base, anchor_ids, sampling, q, None if all_greedy else u, bias, True)
            finally:
                kernels.set_enabled(old)
        outs.append((tok, lg, q))
    (t0, l0, q0), (t1, l1, q1) = outs
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    assert torch.equal(t1, t0)
    assert (t1[:, 0] >= 100).all()
    if not all_greedy:
        torch.testing.assert_close(q1, q0, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_block_on_gpu_is_the_same_with_and_without_the_fused_loop(temperature, monkeypatch):
    """bf16 drafter on CUDA, the public draft_block both ways (models/markov_triton.set_enabled):
    tokens equal (bf16 logits rarely tie), q within float rounding, the same confidences."""
    model = _tiny_drafter(torch.bfloat16)
    R, k, d = 40, 4, 32
    g = torch.Generator().manual_seed(11)
    h = torch.randn(R, k, d, generator=g).to(DEVICE, torch.bfloat16)
    anchor_ids = torch.randint(0, 300, (R,), generator=g).to(DEVICE)
    anchor_pos = torch.randint(10, 90, (R,), generator=g).to(DEVICE)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(R)]
    sampling = SamplingBatch.build(params, list(range(R)), DEVICE)
    props = []
    for flag in (False, True):
        old = mt.set_enabled(flag)
        try:
            props.append(model.draft_block(h, anchor_ids, anchor_pos, sampling, return_logits=True))
        finally:
            mt.set_enabled(old)
    a, b = props
    same = (b.tokens == a.tokens).all(1)  # a row that drew differently has other later slots
    assert same.float().mean().item() >= 0.9
    torch.testing.assert_close(b.logits[same], a.logits[same], rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(b.probs[same], a.probs[same], rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(b.confidences[same], a.confidences[same])


@pytest.mark.parametrize("subtiles", [False, True])
def test_the_loops_slots_are_markov_triton_slots_one_after_another(subtiles, monkeypatch):
    """markov_loop over 5 slots (rows sampled and greedy, a bias on some slots) against
    markov_slot slot by slot, each reading the token before: the same tokens, logits and q; and
    without logits_out (the loop keeps two slots' logits, alternating) the same tokens and q."""
    if subtiles:
        monkeypatch.setattr(ml, "MAX_CHUNKS", 2)
    R, w, V = 7, 5, 230
    g = torch.Generator().manual_seed(17)
    w1, w2 = _weights(V, 16, seed=17)
    base = (torch.randn(R, w, V, generator=g) * 2).to(DEVICE)
    anchors = torch.randint(0, V, (R,), generator=g).to(DEVICE)
    temps = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.0, 2.0], device=DEVICE)
    u = torch.rand(w, R, generator=g).to(DEVICE)
    bias = torch.randn(w, R, V, generator=g).to(DEVICE)
    bias[2, :, 50:] = float("-inf")

    def bias_of(j):
        return None if j == 1 else bias[j]
    tok, lg, q = (torch.empty(R, w, dtype=torch.long, device=DEVICE), torch.empty(R, w, V, device=DEVICE),
                  torch.empty(R, w, V, device=DEVICE))
    prev = anchors
    for j in range(w):
        mt.markov_slot(base[:, j].contiguous(), prev, w1, w2, temps, tok[:, j], lg[:, j], q_out=q[:, j],
                       uniforms=u[j].contiguous(), bias=bias_of(j))
        prev = tok[:, j]
    got_tok, got_lg, got_q = torch.empty_like(tok), torch.empty_like(lg), torch.empty_like(q)
    ml.markov_loop(base, anchors, w1, w2, temps, got_tok, got_lg, q_out=got_q, uniforms=u, bias_of=bias_of)
    assert torch.equal(got_tok, tok)
    assert (tok[:, 2] < 50).all()
    torch.testing.assert_close(got_lg, lg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_q, q, rtol=1e-5, atol=1e-7)
    bare_tok, bare_q = torch.empty_like(tok), torch.empty_like(q)
    ml.markov_loop(base, anchors, w1, w2, temps, bare_tok, None, q_out=bare_q, uniforms=u, bias_of=bias_of)
    assert torch.equal(bare_tok, got_tok)
    assert torch.equal(bare_q, got_q)


@pytest.mark.parametrize("one_kernel_a_slot", [True, False])
def test_kernels_that_fail_before_they_ever_ran_leave_the_torch_loop_with_a_warning(one_kernel_a_slot, monkeypatch):
    """A Triton that cannot compile a variant of the kernels must cost the fused loop, not the
    engine: the first failure of a variant is FusedKernelUnavailable, on which the drafter switches
    the kernels off (warning) and drafts with the torch loop; a variant that once ran re-raises.
    Both launchers: markov_loop_triton's (3 rows) and markov_triton's slots."""
    monkeypatch.setenv("ADASPEC_MARKOV_LOOP_ROWS", "32" if one_kernel_a_slot else "0")
    launcher = ml if one_kernel_a_slot else mt
    model = _tiny_drafter()
    R, k, V = 3, 4, 300
    base = torch.randn(R, k, V, device=DEVICE)
    anchor_ids = torch.zeros(R, dtype=torch.long, device=DEVICE)
    sampling = SamplingBatch.build([SamplingParams(temperature=0.0)] * R, [0] * R, DEVICE)
    monkeypatch.setattr(mt, "_enabled", True)
    monkeypatch.setattr(mt, "proven", set())
    real = launcher._launch
    broken = []

    def launch(*a, **kw):
        if broken:
            raise RuntimeError("no compiler")
        real(*a, **kw)

    monkeypatch.setattr(launcher, "_launch", launch)
    tok, _ = model._markov_loop_fused_or_none(mt, base, anchor_ids, sampling, None, None, None, False)
    assert tok is not None and mt.proven  # the greedy variant ran
    broken.append(1)
    with pytest.raises(RuntimeError, match="no compiler"):  # that variant once ran: a real failure
        model._markov_loop_fused_or_none(mt, base, anchor_ids, sampling, None, None, None, False)
    assert mt.enabled()
    with pytest.warns(RuntimeWarning, match="fused Markov kernels failed .*no compiler"):  # another variant
        assert model._markov_loop_fused_or_none(mt, base, anchor_ids, sampling, None, None, None, True) == (None, None)
    assert not mt.enabled()


def _slot_case(R, V, rank, seed, temps):
    g = torch.Generator().manual_seed(seed)
    w1, w2 = _weights(V, rank, seed=seed)
    base = (torch.randn(R, V, generator=g) * 2).to(DEVICE)
    prev = torch.randint(0, V, (R,), generator=g).to(DEVICE)
    return w1, w2, base, prev, torch.tensor(temps, device=DEVICE)


def test_draw_edges_u_at_zero_and_one_and_a_fully_masked_row(impl):
    """u = 0 with the first tokens masked draws the first token with probability (never a masked
    one); u just below 1 draws the last token with probability; a row whose rules mask everything
    (q is NaN, as torch's softmax gives) still yields a token in range."""
    R, V = 3, 200
    w1, w2, base, prev, temps = _slot_case(R, V, 16, 21, [1.0, 1.0, 1.0])
    bias = torch.zeros(R, V, device=DEVICE)
    bias[0, :70] = float("-inf")  # row 0: tokens 0..69 masked (two whole chunks and part of a third)
    bias[1, 150:] = float("-inf")  # row 1: the tail masked
    bias[2, :] = float("-inf")
    u = torch.tensor([0.0, 1.0 - 2 ** -24, 0.5], device=DEVICE)
    tok, _, q = _run(base, prev, w1, w2, temps, u, bias=bias)
    assert tok[0].item() == 70
    assert tok[1].item() == 149
    assert 0 <= tok[2].item() < V and torch.isnan(q[2]).all()


def test_ties_within_a_chunk_take_the_first_index(impl):
    R, V = 2, 100
    w1, w2 = _weights(V, 16, seed=5)
    w1[0] = 0.0
    base = torch.zeros(R, V, device=DEVICE)
    base[:, [3, 9, 70]] = 2.0  # 3 and 9 share a chunk of 32
    prev = torch.zeros(R, dtype=torch.long, device=DEVICE)
    tok, _, q = _run(base, prev, w1, w2, torch.tensor([0.0, 0.0], device=DEVICE), None, greedy=True)
    assert tok.tolist() == [3, 3]
    tok, _, q = _run(base, prev, w1, w2, torch.tensor([0.0, 1.0], device=DEVICE), torch.tensor([0.3, 0.3], device=DEVICE))
    assert tok[0].item() == 3 and q[0, 3].item() == 1.0 and q[0].sum().item() == 1.0  # greedy row in a draw: one-hot


@pytest.mark.real_chunks
@pytest.mark.parametrize("V", [2048] if not torch.cuda.is_available() else [16384, 151936])
def test_the_real_chunk_sizes_draw_the_inverse_cdf_of_q(V, impl):
    """The module's own chunk sizes (the other tests shrink them), uniforms placed on the running
    sum's boundaries between the probs programs' chunks and one float step either side: every token
    has probability, and it is the float64 inverse CDF of q unless u * total lies within rounding of
    a boundary."""
    R = 24 if not torch.cuda.is_available() else 256
    bq = _chunk_size(V)
    w1, w2, base, prev, _ = _slot_case(1, V, 64, 31, [1.0])
    base, prev = base.expand(R, V).contiguous(), prev.expand(R).contiguous()
    temps = torch.ones(R, device=DEVICE)
    tok, lg, q = _run(base, prev, w1, w2, temps, torch.full((R,), 0.5, device=DEVICE))
    cdf = q[0].double().cumsum(0)
    bounds = cdf[bq - 1::bq][:-1] / cdf[-1]  # the running sum where each probs chunk ends
    u = torch.stack([bounds, torch.nextafter(bounds, torch.zeros_like(bounds)),
                     torch.nextafter(bounds, torch.ones_like(bounds))], 1).flatten()
    u = torch.cat([u, torch.linspace(0, 1 - 2 ** -24, R, dtype=torch.float64, device=u.device)])[:R].float()
    tok, lg, q = _run(base, prev, w1, w2, temps, u)
    assert (q.gather(1, tok[:, None]) > 0).all()
    torch.testing.assert_close(q.sum(1), torch.ones(R, device=DEVICE))
    idx, margin = _inverse_cdf(q, u)
    assert not ((tok != idx) & (margin > 1e-5)).any()


def test_the_loops_row_limit_comes_from_the_environment(monkeypatch):
    from adaspec.models.drafter import markov_loop_rows

    monkeypatch.delenv("ADASPEC_MARKOV_LOOP_ROWS", raising=False)
    assert markov_loop_rows() == ml.MAX_ROWS
    monkeypatch.setenv("ADASPEC_MARKOV_LOOP_ROWS", "16")
    assert markov_loop_rows() == 16
    monkeypatch.setenv("ADASPEC_MARKOV_LOOP_ROWS", "lots")
    with pytest.raises(ValueError, match="ADASPEC_MARKOV_LOOP_ROWS must be a whole number of rows, got 'lots'"):
        markov_loop_rows()


_COMPILE_LOOP_KERNEL = r"""
import itertools
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from adaspec.models import markov_loop_triton as ml

FLAGS = ("LOGITS", "FINISH", "DRAW", "HAS_BIAS", "ROUND_BIAS", "IEEE", "STORE_LOGITS", "RANK", "ROWS_", "BLOCK", "SUBS",
         "NC_P2")
TYPES = {"base_ptr": "*bf16", "w1_ptr": "*bf16", "w2_ptr": "*bf16", "prev_ptr": "*i64", "tok_ptr": "*i64",
         "pi_ptr": "*i32", "ppi_ptr": "*i32"}
# as a launch specializes: a chunk count of 1 is a constant, pointers and strides divisible by 16
ONES = ("NC",)
VARIANTS = [(True, False, True), (True, True, True), (False, True, True), (True, True, False), (False, True, False)]
for V, (logits, finish, draw) in itertools.product((40, 16384, 151936), VARIANTS):
    subs, nc = ml.chunking(V)
    ones = ONES if nc == 1 else ()
    sig = {n: "constexpr" if n in FLAGS or n in ones else TYPES.get(n, "*fp32") if n.endswith("_ptr") else "i32"
           for n in ml._slot_kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(ml._slot_kernel.arg_names)
             if n.endswith("_ptr") or n in ("base_stride", "q_stride", "lg_stride", "plg_stride")}
    consts = dict(LOGITS=logits, FINISH=finish, DRAW=draw, HAS_BIAS=True, ROUND_BIAS=True, IEEE=False,
                  STORE_LOGITS=logits, RANK=64, ROWS_=16, BLOCK=128, SUBS=subs, NC_P2=ml.partials_width(nc),
                  **{n: 1 for n in ones})
    kernel = triton.compile(ASTSource(fn=ml._slot_kernel, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32))
    assert "cubin" in kernel.asm, sorted(kernel.asm)
    print("compiled", V, logits, finish, draw, flush=True)
"""


def test_the_loop_kernel_compiles_for_the_gpu_without_one(tmp_path):
    """Every variant of markov_loop_triton's kernel the drafter launches (the first slot, the
    middle ones, the last finish; sampled and greedy; one chunk a row, 128 chunks, and 16
    sub-tiles a program), specialized as a launch is, compiled for sm_90 down to a cubin by
    Triton's own compiler and ptxas, in a process without the interpreter:
    the interpreter runs what the compiler may refuse (a value defined in one branch of an
    unrolled loop, say). Needs no GPU: skipped only where Triton has no CUDA backend."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: compile, not read back
    run = subprocess.run([sys.executable, "-c", _COMPILE_LOOP_KERNEL], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("compiled") == 15


def test_the_partials_tile_is_never_two_wide_and_the_loop_serves_few_rows_of_small_vocabularies():
    """Triton 3.6 (the GPU machine's, torch 2.11) fails an assertion lowering the draw's scan over a
    partials tile 2 wide (H100 run 64: every one-chunk vocabulary's sampled variant failed to
    compile there; the compile test above, run under Triton 3.6, fails on such a tile). And the
    drafter takes the loop only where the probe found it faster: up to MAX_ROWS rows, one sub-tile
    a program."""
    for V in (1, 40, 128, 129, 300, 4096, 16384, 16385, 151936):
        subs, nc = ml.chunking(V)
        width = ml.partials_width(nc)
        assert width >= max(16, nc) and width & (width - 1) == 0
        assert ml.serves(1, V, ml.MAX_ROWS) == (subs == 1)
    largest = mt.BLOCK_V * ml.MAX_CHUNKS  # one sub-tile a program: 16,384 with the GPU's BLOCK_V
    assert ml.serves(ml.MAX_ROWS, largest, ml.MAX_ROWS) and not ml.serves(ml.MAX_ROWS + 1, largest, ml.MAX_ROWS)
    assert not ml.serves(1, largest + 1, 10 ** 6)  # two sub-tiles a program
    assert not ml.serves(1, 8, 0)  # ADASPEC_MARKOV_LOOP_ROWS=0: never
