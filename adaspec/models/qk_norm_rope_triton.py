"""q/k RMSNorm, RoPE and the paged cache write of one attention layer in ONE Triton kernel.

Why: compiled by inductor (models/fused.qk_norm_rope_write_kv), these ops take three kernels a
layer in the verify graph (q's norm and RoPE, k's, and a pointwise one that writes the cache) and
two in the decode graph. On the H100 (H100 run 57's profile, Qwen3-0.6B shape, one request) they
cost 227 us of the 1.55 ms verify replay at 8 query rows and 114 us of the 1.26 ms decode replay:
~4.2 us for a q kernel over 8 x 16 heads that takes ~1.7 us at one row. A layer's work here is
(rows x (Hq + Hkv)) independent heads of head_dim values, so one launch with one program per
(row, head) does all of it.

Program (t, g), grid (rows, ceil(Hq / HB) + ceil(Hkv / HB)), HB heads a program (heads_per_program):
- g < ceil(Hq / HB): q's heads g*HB .. g*HB + HB - 1 of row t (those < Hq), normed (optional
  weight), rotated at positions[t], stored to the returned q [T, Hq, D];
- else: k's heads of the group, normed and rotated, stored to k_cache[slots[t]], and v's heads
  copied to v_cache[slots[t]].
With Hq = 0 (q a [T, 0, D] view) the grid holds key/value heads only: the drafter's context,
which has no queries (fused.kv_written_by_kernel).

HB is 1 below GROUPED_FROM_ROWS rows (decode at a few requests: the most programs, each one's
latency the call's) and 8 from there. One head per program at every size launched ~48,000
programs of 256 bytes for a 2,000-row chunk of the 0.6B shape: in H200 run 76's profile of a
256-request step the kernel took 0.84 ms a step (12% of its kernel time), ~18 us a call. First
measured in H100 run 77 (an A/B of trees, not interleaved, a host that swung 2.5-6.3 ms on its
probe): the steps that carry prompt chunks ran 4-12% shorter in no-spec and fixed:3 at 64 and 256
requests, the speculative arms' whole figures within their spreads. A group's norm sums in another
order, so its values can differ from one head a program's by a rounding step of the dtype.

Numerics follow the eager functions (fused.rms_norm, fused._rotate) step by step: the norm in
float32, rounded to the input's dtype, times the weight rounded again (as `weight * x` in bf16),
RoPE in float32 and rounded once; only the order of the mean's sum and the rsqrt differ, so
results agree with eager to a rounding step of the input's dtype.

The default on CUDA since H100 run 58 (``ADASPEC_FUSED_KV_WRITE``, models/fused.py: "1" runs the
compiled function instead, "0" separate index_copy_ writes): its GPU tests passed, the verify
graph's 28 layers spent 61 us in it where the compiled version took 227 us, and on the synthetic
0.6B shape at T = 1 no-spec and adaptive:7 ran 1.07x faster at one request, 1.03-1.04x at 64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normed_rotated(src, w_ptr, c1, c2, s1, s2, eps, offs, mask, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """A group of heads' two halves ([heads, HALF] each; src: each head's start, [heads, 1]), normed
    then rotated, in float32 (eager's roundings replayed)."""
    dtype = src.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        r = (1.0 / tl.sqrt(mean_sq + eps))[:, None]
        w1 = tl.load(w_ptr + offs).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _qk_norm_rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, qo_ptr, kc_ptr, vc_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, cos_st, sin_st, qo_st, qo_sh, kc_ss, kc_sh, vc_ss, vc_sh, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    NQ: tl.constexpr = (HQ + HB - 1) // HB  # programs of query heads a row
    offs = tl.arange(0, HALF)[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * cos_st + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * cos_st + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * sin_st + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * sin_st + HALF + offs).to(tl.float32)
    if g < NQ:
        h = (g * HB + tl.arange(0, HB))[:, None]
        mask = h < HQ
        o1, o2 = _normed_rotated(q_ptr + t * q_st + h * q_sh, qw_ptr, c1, c2, s1, s2, eps, offs, mask, HALF,
                                 HAS_NORM)
        dst = qo_ptr + t * qo_st + h * qo_sh
        out_dtype = qo_ptr.dtype.element_ty
        tl.store(dst + offs, o1.to(out_dtype), mask=mask)
        tl.store(dst + HALF + offs, o2.to(out_dtype), mask=mask)
    else:
        j = ((g - NQ) * HB + tl.arange(0, HB))[:, None]
        mask = j < HKV
        slot = tl.load(slot_ptr + t).to(tl.int64)
        o1, o2 = _normed_rotated(k_ptr + t * k_st + j * k_sh, kw_ptr, c1, c2, s1, s2, eps, offs, mask, HALF,
                                 HAS_NORM)
        # rounded to the model's dtype (eager's k), then to the cache's (write_kv's .to)
        k_dtype = k_ptr.dtype.element_ty
        kc_dtype = kc_ptr.dtype.element_ty
        dst = kc_ptr + slot * kc_ss + j * kc_sh
        tl.store(dst + offs, o1.to(k_dtype).to(kc_dtype), mask=mask)
        tl.store(dst + HALF + offs, o2.to(k_dtype).to(kc_dtype), mask=mask)
        src = v_ptr + t * v_st + j * v_sh
        vdst = vc_ptr + slot * vc_ss + j * vc_sh
        vc_dtype = vc_ptr.dtype.element_ty
        tl.store(vdst + offs, tl.load(src + offs, mask=mask).to(vc_dtype), mask=mask)
        tl.store(vdst + HALF + offs, tl.load(src + HALF + offs, mask=mask).to(vc_dtype), mask=mask)


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                sin_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> str | None:
    """Why the kernel cannot take these arguments (None: it can). The caller then runs the
    compiled function, which takes any shape."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "q, k and v must be [rows, heads, head_dim]"
    D = q.shape[-1]
    if D % 2 or (D // 2) & (D // 2 - 1) or D < 2:
        return f"head_dim {D} is not twice a power of two"
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache, cos_table, sin_table)):
        return "a head's values are not contiguous"
    T = q.shape[0]
    if positions.shape != (T,) or slots.shape != (T,) or k.shape[0] != T or v.shape[0] != T:
        return "positions, slots, k and v must have q's rows"
    if k_cache.dim() != 3 or v_cache.dim() != 3 or k_cache.shape[1:] != k.shape[1:] or v_cache.shape[1:] != v.shape[1:]:
        return "the caches must be [slots, kv_heads, head_dim] of k's heads"
    return None


def qk_norm_rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                 cos_table: torch.Tensor, sin_table: torch.Tensor, q_weight: torch.Tensor | None,
                                 k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """fused.qk_norm_rope_write_kv's semantics (same arguments) in one launch -> q [T, Hq, D]
    (contiguous). The arguments must pass `unsupported`."""
    why = unsupported(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots)
    if why is None and (q_weight is None) != (k_weight is None):
        why = "q_weight and k_weight must both be given (Qwen3's q/k norms) or both be None"
    if why is not None:
        raise ValueError(f"qk_norm_rope_write_kv_triton: {why}")
    return launch(q, k, v, positions, cos_table, sin_table, q_weight, k_weight, eps, k_cache, v_cache, slots)


GROUPED_FROM_ROWS = 64  # rows from which a program takes a group of heads
GROUP_HEADS = 8  # heads a program takes from there


def heads_per_program(rows: int, heads: int) -> int:
    """Heads one program normalizes, rotates and writes: 1 (the most programs) for a few rows, where
    the grid is small and each program's latency is the step's; a group of up to GROUP_HEADS for
    many rows (prefill chunks, verify rows at high load), where one program per head launched
    ~48,000 programs of 256 bytes for 2,000 rows of the 0.6B shape's 24 heads, 18 us a call at 256
    requests on the H200 (run 76's profile), likely the programs' own overhead rather than the bytes
    (an estimate from sizes: H100 run 77 did not time the kernel alone)."""
    if rows < GROUPED_FROM_ROWS:
        return 1
    return min(GROUP_HEADS, triton.next_power_of_2(max(heads, 1)))


def launch(q, k, v, positions, cos_table, sin_table, q_weight, k_weight, eps, k_cache, v_cache, slots,
           heads_per_prog: int | None = None) -> torch.Tensor:
    """qk_norm_rope_write_kv_triton without its check, for a caller that ran `unsupported` (the
    layers' dispatch, fused.q_with_kv_written: one check a layer call, not two). heads_per_prog
    (a power of two; tests): the heads a program takes, instead of heads_per_program's choice."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if heads_per_prog is not None and (heads_per_prog < 1 or heads_per_prog & (heads_per_prog - 1)):
        raise ValueError(f"heads_per_prog must be a power of two (a Triton block), got {heads_per_prog}")
    hb = heads_per_prog or heads_per_program(T, max(Hq, Hkv))
    has_norm = q_weight is not None
    grid = (T, -(-Hq // hb) + -(-Hkv // hb))
    _qk_norm_rope_write_kv_kernel[grid](
        q, k, v, positions, cos_table, sin_table, q_weight if has_norm else q, k_weight if has_norm else k,
        slots, out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_table.stride(0),
        sin_table.stride(0), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), float(eps), HQ=Hq, HKV=Hkv, HB=hb, HALF=D // 2, HAS_NORM=has_norm,
        num_warps=1 if hb == 1 else 4,
    )
    return out
