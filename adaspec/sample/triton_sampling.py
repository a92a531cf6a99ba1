"""Triton kernels for the sampler on CUDA: a row's distribution in one kernel, and its inverse-CDF
draw in the same kernel or in one of its own.

Why: written as torch ops, `processed_probs` without filters (divide, softmax, greedy one-hot)
and `sample_categorical` (cumsum, clamp, searchsorted, guards) are ~15 kernels a call, each a full
pass over a [rows, vocabulary] float32 block. The drafter samples its k slots one after another at
T > 0 (slot j's Markov head reads slot j - 1's token), so a speculative step paid that ~k times: on
the H200 the T = 1 graphed step took 2.06 ms against 1.80 at T = 0 at one request (BENCHMARKS.md,
run 36), and the float cumsum alone was 5% of the adaptive step's kernel time at 256 requests
(run 38's profile). Here one program owns one row and walks it in BLOCK-wide chunks: pass 1 finds
the row's max (online softmax sum, and the raw argmax for greedy rows or for a caller that asks for
it: probs_and_argmax), pass 2 writes the probabilities, pass 3 (draws only) scans them for the
sampled index. `sample_tokens` (a step's next token per row, no probabilities wanted) branches per
row: a greedy row makes the argmax pass only and writes nothing, so a step whose rows are all
greedy reads its logits once, where the probabilities, the draw and a separate argmax made five
passes over the logits or the probabilities and wrote the probabilities once (0.4 ms a step at 256
requests of Qwen3-8B's 151,936-token vocabulary: H100 run 69's profile).

Semantics are the torch functions' (sample/probs.py, sample/random.py), up to float rounding:
- probabilities: softmax(logits / T) per row; a row with T <= 0 is the one-hot of the raw logits'
  first argmax when `greedy_rows` is set, else softmax(logits) (processed_probs's any_greedy).
- draw: the first index whose running sum of the weights exceeds u * total, where total is the
  running sum at the row's end; when u * total is the total (u = 1, which keyed uniforms never
  are), the first index that reaches it (as the eager clamp to just below the total); an all-zero
  row gives 0. Zero weights are never drawn.
The running sum is summed chunk by chunk (tl.cumsum within a chunk, carried across chunks), so
its last bits differ from torch's cumsum: a draw can differ from the eager one only when its
uniform lies within rounding of a CDF boundary (spec_decode/lockstep.py measures such flips).
A draw fused with its probabilities (`draw_from_logits`) equals `draw` over the probabilities it
wrote, bit for bit: both scan the same float32 values with the same chunking.

Everything is device work (no host sync), so CUDA graphs capture the kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 4096  # a chunk: 16 KB of float32 per pass, 4 iterations over a 16k vocabulary
_NUM_WARPS = 8


def _block(V: int) -> int:
    return min(_MAX_BLOCK, triton.next_power_of_2(max(V, 16)))


@triton.jit
def _scan_total(p, carry):
    """The running sum after this chunk (p >= 0, so the largest running value is the last)."""
    return tl.max(tl.cumsum(p, 0) + carry, 0)


@triton.jit
def _find(row_ptr, u, total, V, BLOCK: tl.constexpr):
    """The inverse-CDF index over weights row_ptr[0:V] whose running sum ends at `total`."""
    offs = tl.arange(0, BLOCK)
    target = u * total
    carry = total * 0.0
    found = V
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        p = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        cs = tl.cumsum(p, 0) + carry
        # past the target; or reaching the total when the target is the total (u = 1)
        hit = ((cs > target) | (cs >= total)) & mask
        found = tl.minimum(found, tl.min(tl.where(hit, cols, V), 0))
        carry = tl.max(cs, 0)
    return tl.where(total > 0, tl.minimum(found, V - 1), 0)


@triton.jit
def _argmax_update(x, cols, mask, V, best, best_i):
    """(best, best_i) after a chunk x of a row: the first index of the largest raw logit so far."""
    cmax = tl.max(x, 0)
    cidx = tl.min(tl.where((x == cmax) & mask, cols, V), 0)
    take = cmax > best
    return tl.where(take, cmax, best), tl.where(take, cidx, best_i)


@triton.jit
def _row_argmax(in_row, V, BLOCK: tl.constexpr):
    """The first index of a row's largest raw logit, in one pass that writes nothing."""
    offs = tl.arange(0, BLOCK)
    best = -float("inf")
    best_i = V * 0
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(in_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        best, best_i = _argmax_update(x, cols, mask, V, best, best_i)
    return best_i


@triton.jit
def _row_softmax_stats(in_row, t, V, ARGMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 over a row: (the max m of x / t, the sum of exp(x / t - m), both online; with ARGMAX
    the first index of the raw logits' max, else 0)."""
    offs = tl.arange(0, BLOCK)
    m = -float("inf")
    s = 0.0
    best = -float("inf")
    best_i = V * 0
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(in_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        if ARGMAX:
            best, best_i = _argmax_update(x, cols, mask, V, best, best_i)
        y = x / t
        m_new = tl.maximum(m, tl.max(y, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(y - m_new), 0)
        m = m_new
    return m, s, best_i


@triton.jit
def _write_probs(in_row, out_row, t, m, s, greedy, best_i, V, GREEDY_ROWS: tl.constexpr, DRAW: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Pass 2: the row's probabilities exp(x / t - m) / s into out_row (with GREEDY_ROWS a greedy
    row's one-hot on best_i instead) -> their running total (DRAW; else 0)."""
    offs = tl.arange(0, BLOCK)
    total = s * 0.0
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(in_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        p = tl.exp(x / t - m) / s
        if GREEDY_ROWS:
            p = tl.where(greedy, tl.where(cols == best_i, 1.0, 0.0), p)
        p = tl.where(mask, p, 0.0)
        tl.store(out_row + cols, p, mask=mask)
        if DRAW:
            total = _scan_total(p, total)
    return total


@triton.jit
def _probs_kernel(logits_ptr, logits_stride, index_ptr, temp_ptr, u_ptr, out_ptr, out_stride, token_ptr, argmax_ptr,
                  V, HAS_INDEX: tl.constexpr, GREEDY_ROWS: tl.constexpr, DRAW: tl.constexpr, ARGMAX: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if HAS_INDEX:
        src = tl.load(index_ptr + row).to(tl.int64)
    else:
        src = row
    in_row = logits_ptr + src * logits_stride
    out_row = out_ptr + row * out_stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    # pass 1: max and sum of exp(x / t) (online), and the first argmax of the raw logits
    m, s, best_i = _row_softmax_stats(in_row, t, V, ARGMAX=GREEDY_ROWS or ARGMAX, BLOCK=BLOCK)
    # pass 2: the probabilities (and, for a draw, their running total)
    total = _write_probs(in_row, out_row, t, m, s, greedy, best_i, V, GREEDY_ROWS=GREEDY_ROWS, DRAW=DRAW,
                         BLOCK=BLOCK)
    if DRAW:
        tl.debug_barrier()  # pass 3 reads what other threads of this program stored in pass 2
        tok = _find(out_row, tl.load(u_ptr + row), total, V, BLOCK)
        tl.store(token_ptr + row, tok.to(tl.int64))
    if ARGMAX:
        tl.store(argmax_ptr + row, best_i.to(tl.int64))


@triton.jit
def _token_kernel(logits_ptr, logits_stride, temp_ptr, u_ptr, scratch_ptr, scratch_stride, token_ptr, V,
                  BLOCK: tl.constexpr):
    """A row's next token: a greedy row reads its logits once (the argmax) and writes nothing; a
    sampled row runs _probs_kernel's passes into its scratch row and draws, as draw_from_logits."""
    row = tl.program_id(0).to(tl.int64)
    in_row = logits_ptr + row * logits_stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    if t > 0:
        out_row = scratch_ptr + row * scratch_stride
        m, s, best_i = _row_softmax_stats(in_row, t, V, ARGMAX=False, BLOCK=BLOCK)
        total = _write_probs(in_row, out_row, t, m, s, t <= 0, best_i, V, GREEDY_ROWS=False, DRAW=True, BLOCK=BLOCK)
        tl.debug_barrier()  # pass 3 reads what other threads of this program stored in pass 2
        tok = _find(out_row, tl.load(u_ptr + row), total, V, BLOCK)
    else:
        tok = _row_argmax(in_row, V, BLOCK)
    tl.store(token_ptr + row, tok.to(tl.int64))


@triton.jit
def _draw_kernel(w_ptr, w_stride, u_ptr, token_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    w_row = w_ptr + row * w_stride
    offs = tl.arange(0, BLOCK)
    total = tl.load(u_ptr + row) * 0.0
    for start in range(0, V, BLOCK):
        cols = start + offs
        p = tl.load(w_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        total = _scan_total(p, total)
    tok = _find(w_row, tl.load(u_ptr + row), total, V, BLOCK)
    tl.store(token_ptr + row, tok.to(tl.int64))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D tensor whose rows are contiguous (what the kernels index)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_probs(logits, temperature, greedy_rows, index, out, uniforms, argmax: bool = False):
    logits = _rows(logits)
    V = logits.shape[-1]
    n = logits.shape[0] if index is None else index.shape[0]
    if out is None:
        out = torch.empty(n, V, dtype=torch.float32, device=logits.device)
    elif out.dtype != torch.float32 or out.stride(-1) != 1 or tuple(out.shape) != (n, V):
        raise ValueError(f"out must be a float32 [{n}, {V}] tensor with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} with strides {out.stride()}")
    draw = uniforms is not None
    tokens = torch.empty(n if draw else 0, dtype=torch.int64, device=logits.device)
    first_max = torch.empty(n if argmax else 0, dtype=torch.int64, device=logits.device)
    temperature = temperature.to(torch.float32).contiguous()
    if n:
        _probs_kernel[(n,)](
            logits, logits.stride(0), index if index is not None else temperature, temperature,
            uniforms.to(torch.float32).contiguous() if draw else temperature, out, out.stride(0), tokens, first_max,
            V, HAS_INDEX=index is not None, GREEDY_ROWS=bool(greedy_rows), DRAW=draw, ARGMAX=argmax,
            BLOCK=_block(V), num_warps=_NUM_WARPS,
        )
    return out, tokens, first_max


def probs(logits: torch.Tensor, temperature: torch.Tensor, greedy_rows: bool = True,
          index: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(logits / T) per row [n, V] float32 (module docstring). index: output row i is logits
    row index[i] (a gather without copying the logits); temperature is per output row."""
    return _launch_probs(logits, temperature, greedy_rows, index, out, None)[0]


def probs_and_argmax(logits: torch.Tensor, temperature: torch.Tensor, greedy_rows: bool = True,
                     index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(`probs`, each output row's first argmax of the raw logits [n] int64): the argmax that
    pass 1 finds anyway, so that a caller needing both (the graphed verify step: greedy rows accept
    by it) saves an argmax reduction over the logits and its gather."""
    p, _, first_max = _launch_probs(logits, temperature, greedy_rows, index, None, None, argmax=True)
    return p, first_max


def draw_from_logits(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor,
                     greedy_rows: bool = True, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n] int64, probs [n, V]): `probs` and then `draw` over them, in one kernel."""
    p, tokens, _ = _launch_probs(logits, temperature, greedy_rows, None, out, uniforms)
    return tokens, p


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's next token [n] int64 (probs.sample_tokens): a row with T <= 0 the first argmax of
    its raw logits, the others draw_from_logits's draw with their uniform."""
    logits = _rows(logits)
    n, V = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        # the sampled rows' probabilities between passes 2 and 3; greedy rows leave theirs untouched
        scratch = torch.empty(n, V, dtype=torch.float32, device=logits.device)
        _token_kernel[(n,)](logits, logits.stride(0), temperature.to(torch.float32).contiguous(),
                            uniforms.to(torch.float32).contiguous(), scratch, scratch.stride(0), tokens, V,
                            BLOCK=_block(V), num_warps=_NUM_WARPS)
    return tokens


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of weights [n, V] (non-negative, unnormalized) by inverse CDF."""
    weights = _rows(weights)
    n, V = weights.shape
    tokens = torch.empty(n, dtype=torch.int64, device=weights.device)
    if n:
        _draw_kernel[(n,)](weights, weights.stride(0), uniforms.to(torch.float32).contiguous(), tokens, V,
                           BLOCK=_block(V), num_warps=_NUM_WARPS)
    return tokens
