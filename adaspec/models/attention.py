"""Paged attention over a packed variable-length batch.

Every request in a step contributes its own number of query tokens (a prefill chunk, a
1-token decode, or a last token plus drafts). Keys/values live in a paged cache: a flat
slot array of `num_blocks * block_size` entries per layer, reached through each request's
block table. The per-step metadata (where to write, what each query may see) is built ONCE
per step by `build_attention_metadata` and shared by all layers.

Visibility is expressed per query token as `kv_limit`: the query sees keys at sequence
positions [0, kv_limit). Causal decoding uses kv_limit = position + 1; the drafter's
bidirectional block uses the block's end. One rule serves both.

Backends:
- "reference": gather each request's keys into a padded [B, max_k] tensor and run SDPA with
  a boolean mask. Works on any device; the CPU path.
- "varlen": gather keys into a packed [sum_k] tensor and call torch's flash varlen kernel
  (`torch.nn.attention.varlen.varlen_attn`, CUDA only, causal masks only).
- "triton": adaspec.models.paged_attention_triton reads K/V through the block tables (no gather);
  causal, or every query of a request seeing all its keys (the drafter's block). CUDA, or CPU
  under TRITON_INTERPRET=1 (tests).
- "paged_torch": the triton backend's contract (same metadata) in plain torch, every request at
  once padded to the longest: for the CPU's runs of code written against that metadata (the
  speculative step's graphs captured eagerly in tests, self-distillation on the CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaspec.h2d import to_device_arrays


@dataclass
class AttentionMetadata:
    backend: str
    slot_mapping: torch.Tensor  # [T] flat cache slot where each query token's K/V is written
    num_seqs: int
    max_q: int
    max_k: int
    # reference backend
    q_seq: torch.Tensor | None = None  # [T] request index of each query token
    q_row: torch.Tensor | None = None  # [T] row of each query token inside its request
    kv_gather: torch.Tensor | None = None  # [B, max_k] cache slots of each request's keys (padded)
    mask: torch.Tensor | None = None  # [B, 1, max_q, max_k] bool, True = visible
    # varlen backend
    cu_q: torch.Tensor | None = None  # [B+1] int32
    cu_k: torch.Tensor | None = None  # [B+1] int32
    kv_gather_flat: torch.Tensor | None = None  # [sum_k] cache slots
    # triton backend (cu_q doubles as its query_start)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    kv_lens: torch.Tensor | None = None  # [B] int32
    causal: bool = True
    block_size: int = 0


def build_attention_metadata(
    backend: str,
    block_tables: list[list[int]],
    query_lens: list[int],
    kv_lens: list[int],
    kv_limits: list[list[int]] | None,
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Per-step attention metadata.

    query_lens[b]: query tokens of request b this step, which are written at sequence
    positions kv_lens[b] - query_lens[b] .. kv_lens[b] - 1. kv_limits[b][i] (optional, default
    causal) is how many keys query i of request b may see.
    """
    import numpy as np

    B = len(query_lens)
    ql = np.asarray(query_lens, dtype=np.int64)
    kl = np.asarray(kv_lens, dtype=np.int64)
    max_q, max_k = int(ql.max()), int(kl.max())
    max_blocks = max(len(bt) for bt in block_tables)
    bt = np.zeros((B, max_blocks), dtype=np.int64)
    for b, row in enumerate(block_tables):
        bt[b, : len(row)] = row
    q_seq = np.repeat(np.arange(B), ql)
    starts = np.cumsum(ql) - ql
    q_row = np.arange(int(ql.sum())) - np.repeat(starts, ql)
    q_pos = np.repeat(kl - ql, ql) + q_row  # sequence position of each query token

    def slot_of(seq, pos):  # the cache slot of sequence position pos of request seq
        return bt[seq, np.minimum(pos // block_size, max_blocks - 1)] * block_size + pos % block_size

    kpos = np.arange(max_k)
    # the slot of every (request, key position) pair only for the backends that gather keys: a
    # decode step of 2,048 requests at 250 keys spent ~11 of its ~15 ms of host metadata on it
    slots = None if backend == "triton" else slot_of(np.arange(B)[:, None], kpos[None, :])  # [B, max_k]
    slot_mapping = slot_of(q_seq, q_pos)
    up: dict[str, tuple] = {"slot_mapping": (slot_mapping, torch.long)}  # uploaded together at the end
    meta = AttentionMetadata(backend=backend, slot_mapping=None, num_seqs=B, max_q=max_q, max_k=max_k)
    if backend == "varlen":
        if kv_limits is not None:
            raise ValueError("the varlen backend supports causal masks only")
        kvalid = kpos[None, :] < kl[:, None]
        up.update(kv_gather_flat=(slots[kvalid], torch.long),
                  cu_q=(np.concatenate([[0], np.cumsum(ql)]), torch.int32),
                  cu_k=(np.concatenate([[0], np.cumsum(kl)]), torch.int32))
    elif backend == "triton":
        if kv_limits is not None:
            lim = np.concatenate([np.asarray(x, dtype=np.int64) for x in kv_limits])
            meta.causal = not np.array_equal(lim, np.repeat(kl, ql))  # else: every query sees all its keys
            if meta.causal and not np.array_equal(lim, q_pos + 1):
                raise ValueError("the triton backend supports causal masks or kv_limits == kv_lens only")
        up.update(block_tables=(bt, torch.int32), cu_q=(np.concatenate([[0], np.cumsum(ql)]), torch.int32),
                  kv_lens=(kl, torch.int32))
        meta.block_size = block_size
    else:
        if kv_limits is None:
            limit = q_pos + 1
        else:
            limit = np.concatenate([np.asarray(x, dtype=np.int64) for x in kv_limits])
        lim = np.ones((B, max_q), dtype=np.int64)  # padded query rows see key 0 (avoids all-masked NaN rows)
        lim[q_seq, q_row] = limit
        mask = kpos[None, None, :] < np.minimum(lim, kl[:, None])[:, :, None]
        up.update(q_seq=(q_seq, torch.long), q_row=(q_row, torch.long),
                  kv_gather=(np.where(kpos[None, :] < kl[:, None], slots, 0), torch.long),
                  mask=(mask[:, None], torch.bool))
    # one host-to-device copy for all of them (on CUDA each copy of its own costs a pinned buffer
    # and a launch: 3-5 per eager forward)
    for name, t in zip(up, to_device_arrays(list(up.values()), device)):
        setattr(meta, name, t)
    return meta


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k_cache/v_cache: [num_slots, H_kv, D]; k/v: [T, H_kv, D]."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], over keys already written to the cache."""
    if meta.backend == "varlen":
        return _varlen(q, k_cache, v_cache, meta, scale)
    if meta.backend == "paged_torch":
        return paged_attention_torch(q, k_cache, v_cache, meta, scale)
    if meta.backend == "triton":
        from adaspec.models.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.cu_q, meta.kv_lens, scale,
                                      meta.causal, block_size=meta.block_size, max_q=meta.max_q, max_k=meta.max_k)
    B, max_q = meta.num_seqs, meta.max_q
    T, Hq, D = q.shape
    q_pad = q.new_zeros(B, max_q, Hq, D)
    q_pad[meta.q_seq, meta.q_row] = q
    keys = k_cache[meta.kv_gather]  # [B, max_k, Hkv, D]
    values = v_cache[meta.kv_gather]
    if q.is_cuda:
        out = _masked_sdpa_cuda(q_pad, keys.to(q.dtype), values.to(q.dtype), meta.mask, scale)
    else:
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=meta.mask, scale=scale, enable_gqa=True,
        )  # [B, Hq, max_q, D]
    return out.transpose(1, 2)[meta.q_seq, meta.q_row]


def _masked_sdpa_cuda(q_pad, keys, values, mask, scale):
    """On CUDA a boolean mask + GQA lands on cuDNN attention, which builds an execution plan per
    new shape, and every step has a new key length. Seen on the H200: the drafter's step took
    70 ms on first shapes, 26 ms once they repeated, and the plan cache restarted per thread (the
    server's engine thread). Expanding the KV heads lets the memory-efficient kernel take it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q_pad.shape[2] // keys.shape[2]
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale)


def _varlen(q, k_cache, v_cache, meta, scale):
    from torch.nn.attention.varlen import varlen_attn

    keys = k_cache[meta.kv_gather_flat].to(q.dtype)
    values = v_cache[meta.kv_gather_flat].to(q.dtype)
    # flash attention aligns the causal mask bottom-right when q is shorter than k: exactly
    # "query i of a request sits at position kv_len - q_len + i"
    return varlen_attn(
        q, keys, values, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, scale=scale, window_size=(-1, 0)
    )


def triton_available() -> bool:
    """The Triton kernel can run: triton imports (CUDA, or CPU under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Training / feature-extraction path. q: [B, T, Hq, D], k/v: [B, T, Hkv, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """The triton backend's semantics in torch (reads the metadata on the host: tests and the CPU).
    Request b's queries are rows cu_q[b]..cu_q[b+1] and its keys positions [0, kv_lens[b]);
    causal: its i-th query sees keys up to position kv_lens - n_queries + i. Rows of a request
    without keys, and spare rows past cu_q[num_seqs], come back zero.

    All requests at once, padded to the longest (keys gathered through the block tables): a loop
    over requests cost one SDPA call per request per layer, most of a CPU test's time with 2,048
    requests in a captured step."""
    out = torch.zeros_like(q)
    B, bs = meta.num_seqs, meta.block_size
    cu = meta.cu_q[: B + 1].long()
    rows = int(cu[-1]) if B else 0  # the query rows the requests own
    if rows == 0:
        return out
    if rows > q.shape[0]:  # the Triton kernel would read (and write) rows past the tensor
        raise ValueError(f"query_start ends at {rows}, past the {q.shape[0]} packed query rows")
    q_lens, kv_lens = cu[1:] - cu[:-1], meta.kv_lens[:B].long()
    max_q, max_k = int(q_lens.max()), int(kv_lens.max())
    if max_k == 0:
        return out
    q_seq = torch.repeat_interleave(torch.arange(B, device=q.device), q_lens)  # each query row's request
    q_row = torch.arange(rows, device=q.device) - cu[q_seq]
    pos = torch.arange(max_k, device=q.device)
    valid = pos[None, :] < kv_lens[:, None]  # [B, max_k]
    blocks = torch.where(valid, meta.block_tables[:B, pos // bs].long(), 0)  # past a request's keys: any block
    slots = blocks * bs + pos % bs
    keys, values = k_cache[slots].to(q.dtype), v_cache[slots].to(q.dtype)  # [B, max_k, Hkv, D]
    mask = valid[:, None, :].expand(B, max_q, max_k)
    if meta.causal:
        last = (kv_lens - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]  # [B, max_q]
        mask = mask & (pos[None, None, :] <= last[:, :, None])
    q_pad = q.new_zeros(B, max_q, *q.shape[1:])
    q_pad[q_seq, q_row] = q[:rows]
    res = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)[q_seq, q_row]
    out[:rows] = torch.where((kv_lens[q_seq] > 0)[:, None, None], res, 0)
    return out
