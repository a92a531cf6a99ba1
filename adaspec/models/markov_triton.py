"""One slot of the drafter's Markov loop on CUDA in two or three Triton kernels.

Why: the loop is the semi-autoregressive part of a speculative step (slot j's bias reads slot
j - 1's token), so its kernels run k times one after another. As torch ops each slot was an
embedding lookup, the rank-r matmul, the add of the bias to the slot's logits, then the sampler's
kernel (sample/triton_sampling.py), one program per row walking the whole vocabulary three
times: on the H100 at one request the loop cost ~25 us a slot, ~0.18 ms of a 2.1 ms step
(BENCHMARKS.md, run 53's profile), the largest part of what drafting adds to a decode step at the
per-user end. Here:

- ``_logits_kernel``, grid (row groups of ROWS, vocabulary chunks of BLOCK_V): the bias
  B(prev, v) = W2[v] . W1[prev] for ROWS rows at once (tl.dot, so W2 is read once per group, not
  per row), plus the slot's base logits U_j (bf16 or float32) and the optional additive rules'
  bias, written as the slot's float32 logits (where a draw or the caller reads them); and per (row, chunk) the partial softmax (max and
  sum of exp(x / T)) and the first argmax of the raw logits.
- ``_probs_kernel`` (sampled rows only), grid (rows, chunks of block_q(V)): combines the row's
  partials into its softmax, writes q = softmax(logits / T) (the one-hot of the first argmax for
  rows with T <= 0) and each chunk's running total.
- ``_pick_kernel``, grid (rows,): the token. Greedy rows: the first argmax. Sampled rows: the
  inverse-CDF draw with the slot's uniform u, the first index whose running sum exceeds
  u * total: one scan over the chunk totals picks the chunk, a scan of that chunk the index.

Semantics are `DSparkDrafter.markov_logits` then `SamplingBatch.draw` (no top-k / top-p: rows
with filters keep the torch loop), up to float rounding: the bias is rounded to the weights' dtype
as nn.Linear rounds it, the softmax is combined from chunks instead of walked online, and the
running sum's rounding is these kernels' own, so a draw can differ from the torch one only when u
lies within rounding of a CDF boundary. Losslessness does not depend on any of that: verification
uses the q written here, which is the distribution the token was drawn from. A token without
probability is never drawn: where the chunk's own scan rounds below the target that the chunk
totals passed (their sums are added in other orders), the draw takes the chunk's last token with
probability, and the row's argmax if the chunk has none (tests/models/test_markov_triton.py).

Everything is device work, so the graphed speculative step captures it.

On by default on CUDA; ``ADASPEC_FUSED_MARKOV=0`` in the environment (or ``set_enabled(False)``)
drafts with the torch loop. On the H100 (BENCHMARKS.md, run 54) the drafter's propose graph took
0.204 ms at one request against the torch loop's 0.312 (27-30% less at 64-256;
benchmarks/probes/spec_step_profile.py --samplers triton-unfused,triton). Run 56 (H100) passed the
engine's test with them on (tests/engine/test_gpu.py: speculation equal to plain decoding) and every
test of tests/models/test_markov_triton.py, and timed the real pair's adaptive:7 at one request,
T = 1, 5.9% and 6.9% faster with them (two orders, one build), no slower at 64 and 256 requests.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_enabled = os.environ.get("ADASPEC_FUSED_MARKOV", "1") != "0"

ROWS = 16  # rows per logits program: tl.dot needs 16 on each side
BLOCK_V = 128  # vocabulary entries per logits program
MAX_RANK = 256  # a larger Markov rank keeps the torch loop (the logits program's weight tile grows with it)
_NUM_WARPS = 4


def block_q(V: int) -> int:
    """Vocabulary entries per probs program (and per chunk of the draw's walk): every probs program
    reads its row's V / BLOCK_V softmax partials, so a large vocabulary gets fewer, wider programs."""
    return 1024 if V <= 32768 else 4096


def set_enabled(flag: bool) -> bool:
    """Use the fused kernels from now on (or not); returns the previous setting. Read when a step
    is drafted, so a CUDA graph keeps what was set when it was captured."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


def enabled() -> bool:
    return _enabled


@triton.jit
def slot_logits(e, w2_ptr, rank, ranks, kmask, rows64, rmask, cols, cmask, base_ptr, base_stride, bias_ptr,
                bias_stride, HAS_BIAS: tl.constexpr, ROUND_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """A [ROWS, BLOCK] tile of a slot's float32 logits U_j + W2 W1[prev] (+ the rules' bias): e
    [ROWS, RANK] the rows' W1[prev]; W2 read once for all the rows (tl.dot)."""
    w = tl.load(w2_ptr + cols.to(tl.int64)[None, :] * rank + ranks[:, None], mask=kmask[:, None] & cmask[None, :],
                other=0.0)
    if IEEE:
        b = tl.dot(e, w, input_precision="ieee")  # [ROWS, BLOCK], float32 accumulation
    else:
        b = tl.dot(e, w)
    if ROUND_BIAS:  # nn.Linear returns the bias in the weights' dtype
        b = b.to(w2_ptr.dtype.element_ty).to(tl.float32)
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(base_ptr + rows64[:, None] * base_stride + cols[None, :], mask=m2, other=0.0).to(tl.float32) + b
    if HAS_BIAS:
        x += tl.load(bias_ptr + rows64[:, None] * bias_stride + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    return x


@triton.jit
def _logits_kernel(base_ptr, base_stride, prev_ptr, prev_stride, w1_ptr, w2_ptr, rank, bias_ptr, bias_stride,
                   temp_ptr, lg_ptr, lg_stride, pm_ptr, ps_ptr, pa_ptr, pi_ptr, R, V, NC,
                   HAS_BIAS: tl.constexpr, ROUND_BIAS: tl.constexpr, IEEE: tl.constexpr, STORE_LOGITS: tl.constexpr,
                   RANK: tl.constexpr, ROWS_: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    c = tl.program_id(1)
    rows = g * ROWS_ + tl.arange(0, ROWS_)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    ranks = tl.arange(0, RANK)
    kmask = ranks < rank
    cols = c * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < V
    prev = tl.load(prev_ptr + rows64 * prev_stride, mask=rmask, other=0).to(tl.int64)
    e = tl.load(w1_ptr + prev[:, None] * rank + ranks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    x = slot_logits(e, w2_ptr, rank, ranks, kmask, rows64, rmask, cols, cmask, base_ptr, base_stride, bias_ptr,
                    bias_stride, HAS_BIAS, ROUND_BIAS, IEEE)
    if STORE_LOGITS:  # what the probs kernel reads (sampled rows) or the caller asked for
        tl.store(lg_ptr + rows64[:, None] * lg_stride + cols[None, :], x, mask=rmask[:, None] & cmask[None, :])
    x = tl.where(cmask[None, :], x, -float("inf"))
    t = tl.load(temp_ptr + rows, mask=rmask, other=1.0).to(tl.float32)
    t = tl.where(t <= 0, 1.0, t)
    amax = tl.max(x, 1)
    aidx = tl.min(tl.where((x == amax[:, None]) & cmask[None, :], cols[None, :], V), 1)
    y = x / t[:, None]
    m = tl.max(y, 1)
    s = tl.sum(tl.exp(y - tl.where(m == -float("inf"), 0.0, m)[:, None]), 1)
    out = rows64 * NC + c
    tl.store(pm_ptr + out, m, mask=rmask)
    tl.store(ps_ptr + out, s, mask=rmask)
    tl.store(pa_ptr + out, amax, mask=rmask)
    tl.store(pi_ptr + out, aidx, mask=rmask)


@triton.jit
def _row_argmax(pa_ptr, pi_ptr, row, NC, V, need, NC_P2: tl.constexpr):
    """The first argmax of a row from its chunks' (max, first index of the max); reads nothing
    (and returns garbage) where `need` is false."""
    offs = tl.arange(0, NC_P2)
    mask = (offs < NC) & ((offs * 0 + need.to(tl.int32)) != 0)  # (a scalar & a vector: not in the interpreter)
    pa = tl.load(pa_ptr + row * NC + offs, mask=mask, other=-float("inf"))
    pi = tl.load(pi_ptr + row * NC + offs, mask=mask, other=V)
    best = tl.max(pa, 0)
    return tl.min(tl.where((pa == best) & mask, pi, V), 0)


@triton.jit
def _probs_kernel(lg_ptr, lg_stride, temp_ptr, pm_ptr, ps_ptr, pa_ptr, pi_ptr, q_ptr, q_stride, tot_ptr, V, NC, NQ,
                  NC_P2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, NC_P2)
    pmask = offs < NC
    pm = tl.load(pm_ptr + row * NC + offs, mask=pmask, other=-float("inf"))
    ps = tl.load(ps_ptr + row * NC + offs, mask=pmask, other=0.0)
    M = tl.max(pm, 0)
    S = tl.sum(tl.where(pm == -float("inf"), 0.0, ps * tl.exp(pm - M)), 0)
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    best = _row_argmax(pa_ptr, pi_ptr, row, NC, V, greedy, NC_P2)  # only greedy rows need it
    cols = c * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < V
    x = tl.load(lg_ptr + row * lg_stride + cols, mask=cmask, other=-float("inf"))
    p = tl.exp(x / t - M) / S
    p = tl.where(greedy, tl.where(cols == best, 1.0, 0.0), p)
    p = tl.where(cmask, p, 0.0)
    tl.store(q_ptr + row * q_stride + cols, p, mask=cmask)
    tl.store(tot_ptr + row * NQ + c, tl.max(tl.cumsum(p, 0), 0))


@triton.jit
def _pick_kernel(u_ptr, pa_ptr, pi_ptr, q_ptr, q_stride, tot_ptr, tok_ptr, tok_stride, V, NC, NQ,
                 ALL_GREEDY: tl.constexpr, NC_P2: tl.constexpr, NQ_P2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    best = _row_argmax(pa_ptr, pi_ptr, row, NC, V, row >= 0, NC_P2)
    if ALL_GREEDY:
        tok = best
    else:
        # the chunk where the running sum over the chunk totals passes u * total, then the index in it
        offs = tl.arange(0, NQ_P2)
        tmask = offs < NQ
        tot = tl.load(tot_ptr + row * NQ + offs, mask=tmask, other=0.0)
        incl = tl.cumsum(tot, 0)
        total = tl.sum(tl.where(offs == NQ - 1, incl, 0.0), 0)
        target = tl.load(u_ptr + row).to(tl.float32) * total
        chunk = tl.min(tl.where(((incl > target) | (incl >= total)) & tmask, offs, NQ), 0)
        chunk = tl.minimum(chunk, NQ - 1)
        base = tl.sum(tl.where(offs == chunk, incl - tot, 0.0), 0)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < V
        p = tl.load(q_ptr + row * q_stride + cols, mask=cmask, other=0.0)
        mass = (p > 0) & cmask  # a token without probability is never drawn
        cs = tl.cumsum(p, 0) + base
        drawn = tl.min(tl.where(((cs > target) | (cs >= total)) & mass, cols, V), 0)
        # the chunk's own running sum can round below the target the chunk totals passed (their
        # sums are added in other orders): its last token with probability then
        last = tl.max(tl.where(mass, cols, -1), 0)
        drawn = tl.where(drawn < V, drawn, last)
        # a chunk without probability (rounding again): the argmax, the likeliest token of all.
        # A greedy row's q is the one-hot of its first argmax, so its draw is that argmax.
        tok = tl.where(drawn >= 0, drawn, best)
    tl.store(tok_ptr + row * tok_stride, tok.to(tl.int64))


class FusedKernelUnavailable(RuntimeError):
    """A variant of the kernels failed the first time it ran in this process (a Triton that cannot
    compile it, say): the caller drafts with the torch loop instead. A variant that once ran and
    then fails raises the original error."""


proven: set[tuple] = set()  # the kernel variants that ran in this process


def check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...], rows: bool) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or (rows and t.stride(-1) != 1):
        want = f"{dtype} {list(shape)}" + (" with contiguous rows" if rows else "")
        raise ValueError(f"{name} must be {want}, got {t.dtype} {list(t.shape)} with strides {t.stride()}")


def check_weights(w1: torch.Tensor, w2: torch.Tensor, V: int) -> None:
    rank = w1.shape[1]
    if not (w1.is_contiguous() and w2.is_contiguous()) or w2.shape != (V, rank) or w1.dtype != w2.dtype:
        raise ValueError(f"w1 [V, r] and w2 [V, r] must be contiguous and of one dtype, got {w1.dtype} "
                         f"{list(w1.shape)} and {w2.dtype} {list(w2.shape)}")
    if rank > MAX_RANK:
        raise ValueError(f"a Markov rank of at most {MAX_RANK} fits the kernels, got {rank}")


def markov_slot(base: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                temperature: torch.Tensor, tokens_out: torch.Tensor, logits_out: torch.Tensor | None = None,
                q_out: torch.Tensor | None = None, uniforms: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> None:
    """One Markov slot for R rows, written into the given views (no allocation but the partials).

    base [R, V]: the slot's U_j (any float dtype, rows contiguous); prev [R] int64: the previous
    tokens (any stride); w1 [V', r], w2 [V, r]: the Markov head's embedding and projection weights
    (one dtype, r <= MAX_RANK); temperature [R] (<= 0: greedy); tokens_out [R] int64 (any stride):
    the drafted tokens; logits_out [R, V] float32: U_j + B(prev) (+ bias), needed for a draw, else
    optional; q_out [R, V] float32 and uniforms [R]: the draft distribution and the draw (both None:
    every row greedy, no q); bias [R, V] float32: the requests' additive rules for this slot, or None.
    Raises FusedKernelUnavailable when a kernel variant fails before it ever ran in the process."""
    R, V = base.shape
    check_tensor(base, "base", base.dtype, (R, V), True)
    if (q_out is None) != (uniforms is None):
        raise ValueError("q_out and uniforms go together: both for a draw, neither when every row is greedy")
    if q_out is not None:
        if logits_out is None:
            raise ValueError("a draw needs logits_out: the probs kernel reads the slot's logits from it")
        check_tensor(q_out, "q_out", torch.float32, (R, V), True)
        check_tensor(uniforms, "uniforms", torch.float32, (R,), False)
    if logits_out is not None:
        check_tensor(logits_out, "logits_out", torch.float32, (R, V), True)
    if bias is not None:
        check_tensor(bias, "bias", torch.float32, (R, V), True)
    check_tensor(prev, "prev", torch.int64, (R,), False)
    check_tensor(tokens_out, "tokens_out", torch.int64, (R,), False)
    check_weights(w1, w2, V)
    if R == 0:
        return
    variant = (q_out is None, bias is not None, logits_out is not None, base.dtype, w2.dtype, V > 32768, str(base.device))
    try:
        _launch(base, prev, w1, w2, temperature.to(torch.float32).contiguous(), tokens_out, logits_out, q_out,
                None if uniforms is None else uniforms.contiguous(), bias)
    except Exception as e:
        if variant in proven:
            raise
        raise FusedKernelUnavailable(f"{type(e).__name__}: {e}") from e
    proven.add(variant)


def _launch(base, prev, w1, w2, temperature, tokens_out, logits_out, q_out, uniforms, bias) -> None:
    R, V = base.shape
    rank = w1.shape[1]
    dev = base.device
    nc = triton.cdiv(V, BLOCK_V)
    bq = block_q(V)
    nq = triton.cdiv(V, bq)
    nc_p2, nq_p2 = triton.next_power_of_2(nc), triton.next_power_of_2(nq)
    pm, ps, pa = (torch.empty(R, nc, dtype=torch.float32, device=dev) for _ in range(3))
    pi = torch.empty(R, nc, dtype=torch.int32, device=dev)
    _logits_kernel[(triton.cdiv(R, ROWS), nc)](
        base, base.stride(0), prev, prev.stride(0), w1, w2, rank,
        bias if bias is not None else base, bias.stride(0) if bias is not None else 0, temperature,
        logits_out if logits_out is not None else pm, logits_out.stride(0) if logits_out is not None else 0,
        pm, ps, pa, pi, R, V, nc,
        HAS_BIAS=bias is not None, ROUND_BIAS=w2.dtype != torch.float32, IEEE=w2.dtype == torch.float32,
        STORE_LOGITS=logits_out is not None, RANK=max(16, triton.next_power_of_2(rank)), ROWS_=ROWS, BLOCK=BLOCK_V,
        num_warps=4,
    )
    if q_out is None:
        _pick_kernel[(R,)](temperature, pa, pi, pm, 0, pm, tokens_out, tokens_out.stride(0), V, nc, nq,
                           ALL_GREEDY=True, NC_P2=nc_p2, NQ_P2=nq_p2, BLOCK=bq, num_warps=_NUM_WARPS)
        return
    tot = torch.empty(R, nq, dtype=torch.float32, device=dev)
    _probs_kernel[(R, nq)](logits_out, logits_out.stride(0), temperature, pm, ps, pa, pi, q_out, q_out.stride(0), tot,
                           V, nc, nq, NC_P2=nc_p2, BLOCK=bq, num_warps=_NUM_WARPS)
    _pick_kernel[(R,)](uniforms, pa, pi, q_out, q_out.stride(0), tot, tokens_out, tokens_out.stride(0), V, nc, nq,
                       ALL_GREEDY=False, NC_P2=nc_p2, NQ_P2=nq_p2, BLOCK=bq, num_warps=_NUM_WARPS)
