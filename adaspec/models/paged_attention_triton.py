"""Triton paged attention over a packed variable-length batch, reading K/V through block tables.

One kernel serves a step that mixes 1-token decodes, (l_r + 1)-token verifications and prefill
chunks: query i of request b sits at sequence position kv_len[b] - q_len[b] + i (causal,
bottom-right aligned) and sees keys [0, position + 1); with causal=False every query of a
request sees all kv_len[b] keys (the drafter's bidirectional block). Same semantics as the
"reference" backend in adaspec.models.attention.

Layout: q/out [T, Hq, D] packed by request (query_start = cu_seqlens), k_cache/v_cache
[num_slots, Hkv, D], slot of key position p of request b =
block_tables[b, p // block_size] * block_size + p % block_size. Nothing is gathered: each program
loads its keys straight from the cache slots.

Work split: one program per (query tile, kv head). A query tile is BLOCK_Q consecutive query
rows of one request times all G = Hq / Hkv query heads of the kv head, flattened into one
BLOCK_M = BLOCK_Q * G_pad row tile, so GQA heads share every K/V load (what makes decode and
verify cheap: they are K/V bandwidth bound). The program walks the request's keys BLOCK_N at
a time with an fp32 online softmax. Query tiles of all requests are laid out on a flat grid
without host bookkeeping: request b owns tiles starting at query_start[b] // BLOCK_Q + b (an
upper bound on the tiles before it), and each program finds its request by binary search;
spare programs exit at once. The grid therefore depends only on (T, B), which keeps a CUDA
graph capture valid for any mix of lengths with those totals.

Split-K (flash decoding): with few (tile, head) programs and long contexts the GPU would sit
mostly idle, so the keys of each tile can be split over `num_splits` programs that write
partial (unnormalised output, max, sum) triples, merged by a second small kernel.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _find_request(tile, qs_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with query_start[b] // BLOCK_Q + b <= tile (binary search over requests)."""
    lo = tile * 0  # int32 scalar
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        start = tl.load(qs_ptr + mid) // BLOCK_Q + mid
        go_right = start <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


# Triton compiles a variant per value class (== 1, divisible by 16, other) of every integer argument
# it specializes; batch size, token count, split count and block-table width change from step to
# step, so they would mean new compiles mid-serving (seconds each: found with py-spy on the H200,
# ~19% of the engine thread at 256 streaming requests). They are runtime values only.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    part_o_ptr, part_ml_ptr,  # split-K partials (unused without SPLIT_K)
    bt_ptr, qs_ptr, kvl_ptr,
    scale_log2, num_seqs, num_tokens, num_q_heads, num_splits,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    b = _find_request(tile, qs_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(qs_ptr + b)
    q_len = tl.load(qs_ptr + b + 1) - q_start
    q_row0 = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if q_row0 >= q_len:  # a spare program of the flat grid
        return
    kv_len = tl.load(kvl_ptr + b)
    ctx = kv_len - q_len  # keys before this step's first query

    offs_m = tl.arange(0, BLOCK_M)
    qi = q_row0 + offs_m // G_PAD  # query row inside the request
    g = offs_m % G_PAD
    row_ok = (qi < q_len) & (g < G)
    head = kvh * G + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if CAUSAL:
        limit = ctx + qi + 1  # keys visible to each row
        last_row = tl.minimum(q_row0 + BLOCK_Q, q_len) - 1
        tile_end = tl.minimum(kv_len, ctx + last_row + 1)
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len
        tile_end = kv_len

    # this split's share of the tile's keys, in whole BLOCK_N steps
    n_steps = tl.cdiv(tile_end, BLOCK_N)
    steps_per_split = tl.cdiv(n_steps, num_splits)
    lo = split * steps_per_split * BLOCK_N
    hi = tl.minimum(tile_end, (split + 1) * steps_per_split * BLOCK_N)

    # finite start value: rows that see no key in this split keep p = 0 instead of NaN
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        k = tl.load(k_ptr + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        visible = n_ok[None, :] & (offs_n[None, :] < limit[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if not SPLIT_K:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # partials laid out [num_splits, T, Hq, BLOCK_D] and [num_splits, T, Hq, 2] (max, sum), contiguous
        row = (split * num_tokens + tok) * num_q_heads + head
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits"])
def _merge_splits_kernel(
    part_o_ptr, part_ml_ptr, o_ptr, qs_ptr, num_seqs, num_tokens, num_q_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    """One program per (token, query head): rescale each split's partial to the global max."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(qs_ptr + num_seqs):  # a spare row no request owns: left as it was
        return
    offs_s = tl.arange(0, MAX_SPLITS)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    row = (offs_s * num_tokens + tok) * num_q_heads + head  # [MAX_SPLITS]
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=-1.0e30)
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_o_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # empty splits carry l = 0, acc = 0
    denom = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


MAX_SPLITS = 16  # split-K programs per tile at most (the merge kernel reads them all at once)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def choose_block_q(max_q: int, gqa: int) -> int:
    """Query rows per tile: at least 16 rows in the tile (tl.dot's minimum), up to 64 rows once
    enough query rows exist (prefill chunks), keeping all GQA heads of a row together."""
    g_pad = _pow2(gqa)
    rows = min(max(_pow2(max_q * g_pad), 16), max(64, g_pad))
    return max(rows // g_pad, 1)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    causal: bool = True,
    *,
    block_size: int,
    max_q: int,
    max_k: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D].

    block_tables [B, max_blocks] int32, query_start [B+1] int32 (cumulative query counts, so
    query_start[-1] == T), kv_lens [B] int32 (keys of each request, this step's included; they
    must already be in the cache). max_q (host int, an upper bound on any request's query count)
    and max_k (the same for keys; optional)
    only picks the tile shape; num_splits > 1 splits each tile's keys over that many programs
    (at most MAX_SPLITS),
    None picks it from the SM count (choose_num_splits; always 1 off CUDA).
    """
    T, Hq, D = q.shape
    num_slots, Hkv, Dk = k_cache.shape
    B = kv_lens.shape[0]
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"head_dim mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if query_start.shape[0] != B + 1 or block_tables.shape[0] != B:
        raise ValueError(f"batch mismatch: query_start {tuple(query_start.shape)}, block_tables "
                         f"{tuple(block_tables.shape)}, kv_lens {tuple(kv_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("query_start", query_start), ("kv_lens", kv_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache and block_tables need a contiguous last dimension")
    query_start, kv_lens = query_start.contiguous(), kv_lens.contiguous()
    if out is None:
        out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    G = Hq // Hkv
    g_pad = _pow2(G)
    block_q = choose_block_q(max_q, G)
    block_d = _pow2(D)
    if block_n is None:
        block_n = 64 if q.is_cuda else 16
    num_tiles = T // block_q + B  # see the module docstring: covers every request's tiles
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles, Hkv, int(k_cache.shape[0]) if max_k is None else max_k, q.device)
    # a runtime argument, not a constant: a new split count must not mean a new compile
    num_splits = min(max(1, int(num_splits)), MAX_SPLITS)
    if num_splits > 1:
        part_o = torch.empty(num_splits, T, Hq, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_splits, T, Hq, 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # never touched
    _paged_attention_kernel[(num_tiles, Hkv, num_splits)](
        q, k_cache, v_cache, out, part_o, part_ml,
        block_tables, query_start, kv_lens,
        float(scale) * math.log2(math.e), B, T, Hq, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        G=G, G_PAD=g_pad, HEAD_DIM=D, BLOCK_D=block_d,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        CAUSAL=bool(causal), SPLIT_K=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if num_splits > 1:
        _merge_splits_kernel[(T, Hq)](
            part_o, part_ml, out, query_start, B, T, Hq, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=D, BLOCK_D=block_d, MAX_SPLITS=MAX_SPLITS,
        )
    return out


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_tiles: int, num_kv_heads: int, max_k: int, device: torch.device) -> int:
    """Flash-decoding split count: enough programs to cover the SMs about twice, but keep at
    least ~256 keys per split (below that the merge costs more than the parallelism buys)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    programs = max(1, num_tiles * num_kv_heads)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_k // 256, MAX_SPLITS))
