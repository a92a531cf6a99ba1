"""The drafter's whole Markov loop on CUDA in one Triton kernel per slot, plus one.

Why: models/markov_triton.py runs a slot in three kernels (logits, q, draw) or two (greedy), one
after another for each of the k slots, because slot j's bias reads slot j - 1's token. At one
request a speculative step is bound by its kernel count (H100 run 63's profile: ~0.06 ms of
kernels in the loop's ~20 launches, and a gap of about a microsecond after each), so the loop's
launches are a share of what drafting adds to a step at the per-user end.

Here kernel j does two things. First it FINISHES slot j - 1 from what kernel j - 1 left (the
slot's logits and, per (row, chunk), the partial softmax and first argmax): every program
combines its rows' partials into the softmax (max M, sum S), draws slot j - 1's token (the first
argmax for greedy rows; for sampled rows the inverse CDF of q = softmax(logits / T) with the
slot's uniform: the chunk from the chunks' totals, then the index from a scan of that chunk's
q), and writes its own chunk of q_{j-1}. Then it computes slot j's logits for its rows and chunk
with that token as the previous one, as markov_triton's logits kernel does. Every program of a
kernel computes the same token for a row from the same partials with the same code, so no program
waits for another; the partials (a few hundred floats a row) are read once per program, which is
the price: it grows with rows x chunks, so the drafter takes this loop for few rows only
(``MAX_ROWS``, or ADASPEC_MARKOV_LOOP_ROWS), and only where a program covers one sub-tile
(``MAX_SUBS``: a vocabulary over 16,384 has fewer, longer programs), and markov_triton's slots
elsewhere (``serves``). A last kernel finishes slot k - 1. So k + 1 launches draft k slots, greedy
or sampled, where the slot kernels took 2k or 3k.

Semantics are markov_triton's (the drafter's torch loop up to float rounding): q is written
with the same expression and the same M and S that the draw used, in the same kernel, so the
token is drawn from exactly the q that verification reads, and a token without probability is
never drawn (the same fallbacks: the chunk's last token with probability, then the argmax).
Chunk totals come from the logits kernel's partial sums here (exp(m_c - M) s_c / S), not from
summing the q written, so a draw can differ from markov_triton's when u lies within rounding of a
CDF boundary, as it already could from torch's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adaspec.models import markov_triton as mt
from adaspec.models.markov_triton import slot_logits

# up to this many rows the drafter drafts with this loop, where a program covers one sub-tile
# (above, every program's read of its rows' partials, rows x chunks of them redundantly per
# program, costs more than the launches it saves). H100 run 64's probe
# (benchmarks/probes/markov_loop_variants.py, 7 slots as graph replays): at V = 16,384 the loop took
# 0.78-0.86x the slots' time up to 16 rows, 0.66-0.96x at 32, 0.91-0.97x at 64 and 1.1-1.5x at 256;
# at V = 151,936 (16 sub-tiles a program) 1.7-3.0x at every rows count, hence MAX_SUBS.
# ADASPEC_MARKOV_LOOP_ROWS in the environment overrides the rows (0: never; models/drafter.py)
MAX_ROWS = 32
MAX_SUBS = 1
MAX_CHUNKS = 128  # partials per row: one [ROWS, 128] tile a program combines in registers


def serves(R: int, V: int, max_rows: int) -> bool:
    """Whether the drafter drafts R rows of vocabulary V with this loop (see MAX_ROWS)."""
    return 0 < R <= max_rows and chunking(V)[0] <= MAX_SUBS


def partials_width(nc: int) -> int:
    """The partials tile's width for nc chunks a row: a power of 2, at least 16. Triton 3.6 (torch
    2.11's) fails an assertion lowering the draw's scan over a tile 2 wide (ScanOpToLLVM.cpp,
    with the launch's divisibility hints; 4 and up compiled), so vocabularies of one or two chunks
    (V <= 256) would lose the fused loop there."""
    return max(16, triton.next_power_of_2(nc))


def chunking(V: int) -> tuple[int, int]:
    """(sub-tiles of BLOCK_V per program chunk, chunks): a program covers enough BLOCK_V-wide
    sub-tiles that a row has at most MAX_CHUNKS chunks (one sub-tile up to V = 128 * BLOCK_V)."""
    subs = triton.next_power_of_2(max(1, triton.cdiv(triton.cdiv(V, mt.BLOCK_V), MAX_CHUNKS)))
    return subs, triton.cdiv(V, mt.BLOCK_V * subs)


@triton.jit
def _stats(pm_ptr, ps_ptr, rows64, rmask, NC, NC_P2: tl.constexpr):
    """Rows' softmax (max M, sum S of exp(y - M), y = logits / T) from their chunks' partials,
    and each chunk's share of S (exp(m_c - M) s_c, 0 for a chunk without probability)."""
    offs = tl.arange(0, NC_P2)
    m2 = rmask[:, None] & (offs[None, :] < NC)
    pm = tl.load(pm_ptr + rows64[:, None] * NC + offs[None, :], mask=m2, other=-float("inf"))
    ps = tl.load(ps_ptr + rows64[:, None] * NC + offs[None, :], mask=m2, other=0.0)
    M = tl.max(pm, 1)
    share = tl.where(pm == -float("inf"), 0.0, ps * tl.exp(pm - M[:, None]))
    return M, tl.sum(share, 1), share


@triton.jit
def _first_argmax(pa_ptr, pi_ptr, rows64, rmask, NC, V, NC_P2: tl.constexpr):
    offs = tl.arange(0, NC_P2)
    m2 = rmask[:, None] & (offs[None, :] < NC)
    pa = tl.load(pa_ptr + rows64[:, None] * NC + offs[None, :], mask=m2, other=-float("inf"))
    pi = tl.load(pi_ptr + rows64[:, None] * NC + offs[None, :], mask=m2, other=V)
    best = tl.max(pa, 1)
    return tl.min(tl.where((pa == best[:, None]) & m2, pi, V), 1)


@triton.jit
def _q(x, t, M, S, greedy, best, cols):
    """q of a [ROWS, BLOCK] tile of logits: softmax(x / T) from the rows' M and S, the one-hot
    of the first argmax for greedy rows. The draw and the written q both come from here."""
    p = tl.exp(x / t[:, None] - M[:, None]) / S[:, None]
    return tl.where(greedy[:, None], tl.where(cols == best[:, None], 1.0, 0.0), p)


@triton.jit
def _slot_kernel(base_ptr, base_stride, prev_ptr, prev_stride, w1_ptr, w2_ptr, rank, bias_ptr, bias_stride,
                 temp_ptr, lg_ptr, lg_stride, pm_ptr, ps_ptr, pa_ptr, pi_ptr,
                 plg_ptr, plg_stride, ppm_ptr, pps_ptr, ppa_ptr, ppi_ptr, u_ptr, q_ptr, q_stride,
                 tok_ptr, tok_stride, R, V, NC,
                 LOGITS: tl.constexpr, FINISH: tl.constexpr, DRAW: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ROUND_BIAS: tl.constexpr, IEEE: tl.constexpr, STORE_LOGITS: tl.constexpr, RANK: tl.constexpr,
                 ROWS_: tl.constexpr, BLOCK: tl.constexpr, SUBS: tl.constexpr, NC_P2: tl.constexpr):
    g = tl.program_id(0)
    c = tl.program_id(1)
    rows = g * ROWS_ + tl.arange(0, ROWS_)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    t = tl.load(temp_ptr + rows, mask=rmask, other=1.0).to(tl.float32)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    lanes = tl.arange(0, BLOCK)
    CHUNK: tl.constexpr = BLOCK * SUBS
    if FINISH:  # slot j - 1: its token, and this program's chunk of its q
        best = _first_argmax(ppa_ptr, ppi_ptr, rows64, rmask, NC, V, NC_P2)
        tok = best
        if DRAW:
            M, S, share = _stats(ppm_ptr, pps_ptr, rows64, rmask, NC, NC_P2)
            # the chunk where the running sum of the chunks' totals passes u * total
            offs = tl.arange(0, NC_P2)
            cm = rmask[:, None] & (offs[None, :] < NC)
            tot = share / S[:, None]
            incl = tl.cumsum(tot, 1)
            total = tl.sum(tl.where(offs[None, :] == NC - 1, incl, 0.0), 1)
            target = tl.load(u_ptr + rows, mask=rmask, other=0.0).to(tl.float32) * total
            chunk = tl.min(tl.where(((incl > target[:, None]) | (incl >= total[:, None])) & cm, offs[None, :], NC), 1)
            chunk = tl.minimum(chunk, NC - 1)
            run = tl.sum(tl.where(offs[None, :] == chunk[:, None], incl - tot, 0.0), 1)
            drawn = tl.full((ROWS_,), V, tl.int32)
            last = tl.full((ROWS_,), -1, tl.int32)
            for s in range(SUBS):  # then the index: a scan of the chunk's q
                cols = chunk[:, None] * CHUNK + s * BLOCK + lanes[None, :]
                m2 = rmask[:, None] & (cols < V)
                x = tl.load(plg_ptr + rows64[:, None] * plg_stride + cols, mask=m2, other=-float("inf"))
                p = tl.where(m2, _q(x, t, M, S, greedy, best, cols), 0.0)
                mass = (p > 0) & m2  # a token without probability is never drawn
                cs = tl.cumsum(p, 1) + run[:, None]
                hit = ((cs > target[:, None]) | (cs >= total[:, None])) & mass
                drawn = tl.minimum(drawn, tl.min(tl.where(hit, cols, V), 1))
                last = tl.maximum(last, tl.max(tl.where(mass, cols, -1), 1))
                run += tl.sum(p, 1)
            # the chunk's own scan rounding below what the totals passed: its last token with
            # probability; a chunk without any (rounding again): the argmax. Greedy rows: the argmax.
            drawn = tl.where(drawn < V, drawn, last)
            tok = tl.where(greedy | (drawn < 0), best, drawn)
            for s in range(SUBS):  # this program's chunk of q_{j-1}
                cols = c * CHUNK + s * BLOCK + lanes
                m2 = rmask[:, None] & (cols[None, :] < V)
                x = tl.load(plg_ptr + rows64[:, None] * plg_stride + cols[None, :], mask=m2, other=-float("inf"))
                tl.store(q_ptr + rows64[:, None] * q_stride + cols[None, :],
                         _q(x, t, M, S, greedy, best, cols[None, :]), mask=m2)
        if c == 0:
            tl.store(tok_ptr + rows64 * tok_stride, tok.to(tl.int64), mask=rmask)
        prev = tok.to(tl.int64)
    else:
        prev = tl.load(prev_ptr + rows64 * prev_stride, mask=rmask, other=0).to(tl.int64)
    if LOGITS:  # slot j: U_j + W2 W1[prev] (+ bias), and per (row, chunk) the partial softmax and argmax
        ranks = tl.arange(0, RANK)
        kmask = ranks < rank
        e = tl.load(w1_ptr + prev[:, None] * rank + ranks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        m = tl.full((ROWS_,), -float("inf"), tl.float32)
        ssum = tl.zeros((ROWS_,), tl.float32)
        amax = tl.full((ROWS_,), -float("inf"), tl.float32)
        aidx = tl.full((ROWS_,), V, tl.int32)
        for s in range(SUBS):
            cols = c * CHUNK + s * BLOCK + lanes
            cmask = cols < V
            x = slot_logits(e, w2_ptr, rank, ranks, kmask, rows64, rmask, cols, cmask, base_ptr, base_stride,
                            bias_ptr, bias_stride, HAS_BIAS, ROUND_BIAS, IEEE)
            m2 = rmask[:, None] & cmask[None, :]
            if STORE_LOGITS:
                tl.store(lg_ptr + rows64[:, None] * lg_stride + cols[None, :], x, mask=m2)
            x = tl.where(cmask[None, :], x, -float("inf"))
            tile_max = tl.max(x, 1)
            tile_idx = tl.min(tl.where((x == tile_max[:, None]) & cmask[None, :], cols[None, :], V), 1)
            aidx = tl.where(tile_max > amax, tile_idx, aidx)  # strictly greater: the first index on ties
            amax = tl.maximum(amax, tile_max)
            y = x / t[:, None]
            m_new = tl.maximum(m, tl.max(y, 1))
            safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            ssum = ssum * tl.exp(m - safe) + tl.sum(tl.exp(y - safe[:, None]), 1)
            m = m_new
        # a chunk whose logits are all -inf (the rules masked it): its first column, as markov_triton's
        aidx = tl.where(aidx == V, c * CHUNK, aidx)
        out = rows64 * NC + c
        tl.store(pm_ptr + out, m, mask=rmask)
        tl.store(ps_ptr + out, ssum, mask=rmask)
        tl.store(pa_ptr + out, amax, mask=rmask)
        tl.store(pi_ptr + out, aidx, mask=rmask)


def markov_loop(base: torch.Tensor, anchor_ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                temperature: torch.Tensor, tokens_out: torch.Tensor, logits_out: torch.Tensor | None = None,
                q_out: torch.Tensor | None = None, uniforms: torch.Tensor | None = None, bias_of=None) -> None:
    """The Markov loop of w slots for R rows in w + 1 kernels, written into the given buffers.

    base [R, w, V]: the slots' U_j (any float dtype, last dim contiguous); anchor_ids [R] int64
    (any stride): slot 0's previous tokens; w1 [V', r], w2 [V, r]: the Markov head's weights (one
    dtype, r <= markov_triton.MAX_RANK); temperature [R] (<= 0: greedy); tokens_out [R, w] int64:
    the drafts; logits_out [R, w, V] float32: every slot's U_j + B(prev) (+ bias), or None when
    the caller does not want them; q_out [R, w, V] float32 and uniforms [w, R] float32: the draft
    distributions and the draws (both None: every row greedy, no q); bias_of: j -> slot j's
    additive rules [R, V] float32 (or None), or None. Raises markov_triton.FusedKernelUnavailable
    when a kernel variant fails before it ever ran in the process."""
    R, w, V = base.shape
    check = mt.check_tensor
    check(base, "base", base.dtype, (R, w, V), True)  # (w = 0: nothing to draft, returns below)
    if (q_out is None) != (uniforms is None):
        raise ValueError("q_out and uniforms go together: both for a draw, neither when every row is greedy")
    if q_out is not None:
        check(q_out, "q_out", torch.float32, (R, w, V), True)
        check(uniforms, "uniforms", torch.float32, (w, R), False)
    if logits_out is not None:
        check(logits_out, "logits_out", torch.float32, (R, w, V), True)
    check(anchor_ids, "anchor_ids", torch.int64, (R,), False)
    check(tokens_out, "tokens_out", torch.int64, (R, w), False)
    mt.check_weights(w1, w2, V)
    biases = [None if bias_of is None else bias_of(j) for j in range(w)]
    for j, b in enumerate(biases):
        if b is not None:
            check(b, f"slot {j}'s bias", torch.float32, (R, V), True)
    if R == 0 or w == 0:
        return
    variant = ("loop", q_out is None, any(b is not None for b in biases), logits_out is not None, base.dtype,
               w2.dtype, chunking(V)[0], str(base.device))
    try:
        _launch(base, anchor_ids, w1, w2, temperature.to(torch.float32).contiguous(), tokens_out, logits_out, q_out,
                None if uniforms is None else uniforms.contiguous(), biases)
    except Exception as e:
        if variant in mt.proven:
            raise
        raise mt.FusedKernelUnavailable(f"{type(e).__name__}: {e}") from e
    mt.proven.add(variant)


def _launch(base, anchor_ids, w1, w2, temperature, tokens_out, logits_out, q_out, uniforms, biases) -> None:
    R, w, V = base.shape
    rank = w1.shape[1]
    dev = base.device
    subs, nc = chunking(V)
    draw = q_out is not None
    # per slot parity: kernel j writes slot j's partials (and logits) while it reads slot j - 1's
    pm, ps, pa = (torch.empty(2, R, nc, dtype=torch.float32, device=dev) for _ in range(3))
    pi = torch.empty(2, R, nc, dtype=torch.int32, device=dev)
    if logits_out is not None:
        lg = [logits_out[:, j] for j in range(w)]
    elif draw:  # a draw reads slot j - 1's logits: two slots' worth, alternating
        pair = torch.empty(2, R, V, dtype=torch.float32, device=dev)
        lg = [pair[j % 2] for j in range(w)]
    else:
        lg = None
    for j in range(w + 1):
        logits, finish = j < w, j > 0
        cur, prv = j % 2, (j - 1) % 2
        here = lg[j] if lg is not None and logits else pm[cur]
        there = lg[j - 1] if lg is not None and finish else pm[prv]
        bias = biases[j] if logits else None
        grid = (triton.cdiv(R, mt.ROWS), nc if logits or draw else 1)
        _slot_kernel[grid](
            base[:, min(j, w - 1)], base.stride(0), anchor_ids, anchor_ids.stride(0), w1, w2, rank,
            bias if bias is not None else pm[cur], bias.stride(0) if bias is not None else 0, temperature,
            here, here.stride(0), pm[cur], ps[cur], pa[cur], pi[cur],
            there, there.stride(0), pm[prv], ps[prv], pa[prv], pi[prv],
            uniforms[j - 1] if draw and finish else temperature,
            q_out[:, j - 1] if draw and finish else pm[prv], q_out.stride(0) if draw else 0,
            tokens_out[:, max(j - 1, 0)], tokens_out.stride(0), R, V, nc,
            LOGITS=logits, FINISH=finish, DRAW=draw, HAS_BIAS=bias is not None, ROUND_BIAS=w2.dtype != torch.float32,
            IEEE=w2.dtype == torch.float32, STORE_LOGITS=logits and lg is not None,
            RANK=max(16, triton.next_power_of_2(rank)), ROWS_=mt.ROWS, BLOCK=mt.BLOCK_V, SUBS=subs,
            NC_P2=partials_width(nc), num_warps=4,
        )
