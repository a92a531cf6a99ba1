"""Each function the engine compiles for CUDA (adaspec/cuda_compiled.py) against its eager
definition on the same CUDA tensors: the speculative step's draft block slots, packed layout,
query counts (fixed and adaptive), verify rows and read back, and rejection sampling's two
halves; integer results equal, float ones within rounding; and none of them fell back to eager
(a compiler failure would hide here otherwise)."""
import pytest
import torch

from adaspec import cuda_compiled as cc
from adaspec.sample import rejection
from adaspec.spec_decode import graphed_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def enabled():
    cc.enable()


def _both(f, *args):
    return f(*args), f.eager(*args)


@pytest.mark.parametrize("B, K", [(1, 7), (5, 3), (64, 7), (3, 0)])
def test_packed_layout(B, K):
    g = torch.Generator(device=DEV).manual_seed(B + K)
    bs, width = 16, 12
    nq = torch.randint(0, K + 2, (B,), device=DEV, generator=g)
    start = torch.randint(0, bs * (width - 1) - K - 1, (B,), device=DEV, generator=g)
    last = torch.randint(0, 1000, (B,), device=DEV, generator=g)
    drafts = torch.randint(0, 1000, (B, K), device=DEV, generator=g)
    tables = torch.randint(0, 500, (B, width), device=DEV, generator=g, dtype=torch.int32)
    got, want = _both(graphed_step.packed_layout, nq, start, last, drafts, tables, bs, 7 * bs, B * (K + 1))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert graphed_step.packed_layout.failed is None


def test_draft_block_slots():
    g = torch.Generator(device=DEV).manual_seed(0)
    anchors = torch.randint(0, 16 * 11 - 8, (37,), device=DEV, generator=g)
    tables = torch.randint(0, 900, (37, 12), device=DEV, generator=g, dtype=torch.int32)
    for b in (1, 37):
        got, want = _both(graphed_step.draft_block_slots, anchors[:b], tables[:b], 8, 16)
        assert all(a.dtype == w.dtype and torch.equal(a, w) for a, w in zip(got, want))
    assert graphed_step.draft_block_slots.failed is None


@pytest.mark.parametrize("R, K, budget", [(1, 7, 7), (16, 7, 40), (256, 3, 300)])
@pytest.mark.parametrize("adaptive", [True, False])
def test_query_counts(R, K, budget, adaptive):
    g = torch.Generator(device=DEV).manual_seed(R)
    conf = torch.rand(R, K, device=DEV, generator=g)
    conf[0, -1] = float("nan")  # a slot the step did not draft
    limits = torch.randint(0, K + 1, (R,), device=DEV, generator=g)
    nq = torch.randint(0, 2, (R,), device=DEV, generator=g)  # 0: a padding request
    args = (nq, limits, conf, torch.tensor(budget, device=DEV), adaptive)
    got, want = _both(graphed_step.query_counts, *args)
    assert torch.equal(got, want) and bool((got <= 1 + limits).all()) and bool((got[nq == 0] == 0).all())
    assert graphed_step.query_counts.failed is None


@pytest.mark.parametrize("B, K", [(1, 7), (9, 3), (64, 7)])
def test_verify_rows_and_readback_rows(B, K):
    g = torch.Generator(device=DEV).manual_seed(B)
    nq = torch.randint(0, K + 2, (B,), device=DEV, generator=g)
    query_start = torch.cat([torch.zeros(1, dtype=torch.int32, device=DEV), torch.cumsum(nq, 0).int()])
    req = torch.randint(0, B, (B * (K + 1),), device=DEV, generator=g)  # each packed row's request
    temps = torch.rand(B, device=DEV, generator=g) * (torch.arange(B, device=DEV) % 3 > 0)  # some greedy
    got, want = _both(graphed_step.verify_rows, query_start, nq, req, temps, K, B * (K + 1))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    for width in (K + 1, 1):  # a step with drafts, and one without (K = 0)
        tokens = torch.randint(0, 1000, (B, width), device=DEV, generator=g)
        n_acc = torch.minimum(got[1], torch.tensor(width - 1, device=DEV))
        start = torch.randint(0, 900, (B,), device=DEV, generator=g)
        got_rb, want_rb = _both(graphed_step.readback_rows, tokens, n_acc, nq, start, K)
        assert all(torch.equal(a, b) for a, b in zip(got_rb, want_rb))
    assert graphed_step.verify_rows.failed is None and graphed_step.readback_rows.failed is None


@pytest.mark.parametrize("N, K, with_q", [(1, 7, True), (33, 7, True), (8, 4, False), (4, 0, True)])
def test_rejection_sampling_halves(N, K, with_q):
    g = torch.Generator(device=DEV).manual_seed(N * 10 + K)
    V = 4096
    p = torch.softmax(3 * torch.randn(N, K + 1, V, device=DEV, generator=g), -1)
    q = torch.softmax(3 * torch.randn(N, K, V, device=DEV, generator=g), -1) if with_q else None
    x = torch.randint(0, V, (N, K), device=DEV, generator=g)
    if K:
        x[:, 0] = p[:, 0].argmax(-1)  # some accepted drafts
    nv = torch.randint(0, K + 1, (N,), device=DEV, generator=g)
    greedy = torch.arange(N, device=DEV) % 3 == 0
    seeds, anchors = torch.arange(N, device=DEV) * 7919, torch.randint(5, 500, (N,), device=DEV, generator=g)
    got = rejection._accept_prefix(x, nv, p, q, greedy, seeds, anchors, None, None)
    want = rejection._accept_prefix.eager(x, nv, p, q, greedy, seeds, anchors, None, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    sampled = torch.randint(0, V, (N,), device=DEV, generator=g)
    out, emitted = rejection._emitted(x, got[0], greedy, got[2], sampled)
    out_e, emitted_e = rejection._emitted.eager(x, got[0], greedy, got[2], sampled)
    assert torch.equal(out, out_e) and torch.equal(emitted, emitted_e)
    assert rejection._accept_prefix.failed is None and rejection._emitted.failed is None


@pytest.mark.parametrize("with_q", [True, False])
def test_fused_rejection_sampling_equals_the_plain_one_on_cuda(with_q):
    """fused=True (the graphed step's compiled halves with the hash inside) against the plain
    assembly (eager paths: keyed_uniforms' own compiled hash, the Triton draw): every output equal."""
    g = torch.Generator(device=DEV).manual_seed(3)
    N, K, V = 48, 7, 16384
    p = torch.softmax(3 * torch.randn(N, K + 1, V, device=DEV, generator=g), -1)
    q = torch.softmax(3 * torch.randn(N, K, V, device=DEV, generator=g), -1) if with_q else None
    x = torch.randint(0, V, (N, K), device=DEV, generator=g)
    x[:, :2] = p[:, :2].argmax(-1)
    nv = torch.randint(0, K + 1, (N,), device=DEV, generator=g)
    greedy = torch.arange(N, device=DEV) % 5 == 0
    seeds, anchors = torch.arange(N, device=DEV) * 31 + 7, torch.randint(5, 900, (N,), device=DEV, generator=g)
    plain = rejection.rejection_sample(x, nv, p, q, greedy, seeds, anchors)
    fused = rejection.rejection_sample(x, nv, p, q, greedy, seeds, anchors, fused=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))
    assert rejection._accept_prefix.failed is None


def test_compiled_functions_replay_inside_a_cuda_graph():
    """As the speculative step uses them: warmed up, captured into a CUDA graph over static
    buffers, then replayed after the inputs changed in place: the replay must compute the new
    inputs' values (the eager definition's), not the captured ones."""
    B, K, bs, width = 8, 7, 16, 12
    g = torch.Generator(device=DEV).manual_seed(11)
    nq = torch.zeros(B, dtype=torch.long, device=DEV)
    start, last = torch.zeros_like(nq), torch.zeros_like(nq)
    drafts = torch.zeros(B, K, dtype=torch.long, device=DEV)
    tables = torch.zeros(B, width, dtype=torch.int32, device=DEV)
    conf, limits, budget = torch.rand(B, K, device=DEV), torch.full((B,), K, device=DEV), torch.tensor(20, device=DEV)

    def fill():
        nq.copy_(torch.randint(1, K + 2, (B,), device=DEV, generator=g))
        start.copy_(torch.randint(0, bs * (width - 1) - K - 1, (B,), device=DEV, generator=g))
        last.copy_(torch.randint(0, 1000, (B,), device=DEV, generator=g))
        drafts.copy_(torch.randint(0, 1000, (B, K), device=DEV, generator=g))
        tables.copy_(torch.randint(0, 500, (B, width), device=DEV, generator=g, dtype=torch.int32))
        conf.copy_(torch.rand(B, K, device=DEV, generator=g))

    def step():
        layout = graphed_step.packed_layout(nq, start, last, drafts, tables, bs, 7 * bs, B * (K + 1))
        counts = graphed_step.query_counts(nq, limits, conf, budget, True)
        return layout, counts

    fill()
    step()  # warm-up: compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        fill()
        graph.replay()
        want = (graphed_step.packed_layout.eager(nq, start, last, drafts, tables, bs, 7 * bs, B * (K + 1)),
                graphed_step.query_counts.eager(nq, limits, conf, budget, True))
        for a, b in zip(out[0], want[0]):
            assert torch.equal(a, b)
        assert torch.equal(out[1], want[1])
    assert graphed_step.packed_layout.failed is None and graphed_step.query_counts.failed is None


def test_qk_norm_rope_write_kv_writes_the_cache_in_place_on_cuda():
    """models/fused.qk_norm_rope_write_kv (the default cache writes) compiled against its eager
    definition, bf16 caches as views of one storage as allocate_kv_caches makes them: the same
    queries and cache contents within rounding, every other slot untouched, two layers (two
    storage offsets) and two batch sizes, and no fallback to eager. Rotary tables of unit
    cos/sin as the engine's are; the tolerance is a few bf16 steps of the output's scale, since
    eager rounds the normed q and k to bf16 before RoPE and the compiled kernel does not (where
    RoPE's two terms cancel, an element-wise relative tolerance would fail on that alone: it did
    on the H100, run 57, with random tables)."""
    from adaspec.models import fused

    g = torch.Generator(device=DEV).manual_seed(3)
    S, Hq, Hkv, D = 4096, 16, 8, 128
    storage = torch.randn(3, 2, S, Hkv, D, device=DEV, generator=g).bfloat16()
    angles = torch.rand(2048, D, device=DEV, generator=g) * 6.2832
    cos, sin = angles.cos(), angles.sin()
    qw, kw = torch.randn(D, device=DEV, generator=g).bfloat16(), torch.randn(D, device=DEV, generator=g).bfloat16()
    f = fused.ops.qk_norm_rope_write_kv
    for layer, T in ((0, 1), (2, 37)):
        q, k, v = (torch.randn(T, h, D, device=DEV, generator=g).bfloat16() for h in (Hq, Hkv, Hkv))
        pos = torch.randint(0, 2048, (T,), device=DEV, generator=g)
        slots = torch.randperm(S, device=DEV, generator=g)[:T]
        want = storage.clone()
        q_want = f.eager(q, k, v, pos, cos, sin, qw, kw, 1e-6, want[layer, 0], want[layer, 1], slots)
        q_got = f(q, k, v, pos, cos, sin, qw, kw, 1e-6, storage[layer, 0], storage[layer, 1], slots)
        _close_at_scale(q_got, q_want, "q")
        _close_at_scale(storage, want, "the cache")
        others = torch.ones(S, dtype=torch.bool, device=DEV)
        others[slots] = False
        assert torch.equal(storage[:, :, others], want[:, :, others])
    assert f.failed is None


def _close_at_scale(got: torch.Tensor, want: torch.Tensor, what: str, steps: int = 4) -> None:
    """got within `steps` bf16 rounding steps (2^-8 relative) of want's largest magnitude."""
    err, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert err <= steps * 2 ** -8 * scale, f"{what}: max error {err} at scale {scale}"


def test_the_drafters_block_ids_uniforms_and_confidences():
    """The propose graph's compiled bookkeeping (models/drafter.py): block token ids and DRAFT
    uniforms equal, confidences within rounding, with and without greedy temperatures."""
    from adaspec.models import drafter as dr

    g = torch.Generator(device=DEV).manual_seed(3)
    R, w, d, r, V = 5, 7, 64, 16, 300
    anchor_ids = torch.randint(0, V, (R,), device=DEV, generator=g)
    got, want = _both(dr.block_token_ids, anchor_ids, w, 3)
    assert torch.equal(got, want) and torch.equal(got[:, 0], anchor_ids)
    seeds = torch.randint(0, 2**62, (R,), device=DEV, generator=g)
    anchors = torch.randint(0, 900, (R,), device=DEV, generator=g)
    got, want = _both(dr.draft_uniforms, seeds, anchors, w)
    assert got.shape == (w, R) and torch.equal(got, want)
    h = torch.randn(R, w, d, device=DEV, generator=g).bfloat16()
    tokens = torch.randint(0, V, (R, w), device=DEV, generator=g)
    w1 = torch.randn(V, r, device=DEV, generator=g).bfloat16()
    weight = torch.randn(1, d + r, device=DEV, generator=g).bfloat16()
    bias = torch.randn(1, device=DEV, generator=g).bfloat16()
    temps, temps_greedy = torch.rand(w, device=DEV, generator=g) + 0.5, torch.rand(w, device=DEV, generator=g) + 0.5
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.0], device=DEV)
    for tg in (temps_greedy, None):
        got, want = _both(dr.slot_confidences, h, anchor_ids, tokens, w1, weight, bias, temps, tg, temperature)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert all(f.failed is None for f in (dr.block_token_ids, dr.draft_uniforms, dr.slot_confidences))
