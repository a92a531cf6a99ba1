"""The "paged_torch" backend (models/attention.paged_attention_torch: the Triton kernel's
metadata read in plain torch, all requests at once) against a brute force that attends one
request at a time: random batches of decodes, verifications and prefill chunks, causal and not,
GQA, shuffled block tables, requests without queries or keys, and spare query rows."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from adaspec.models.attention import AttentionMetadata, paged_attention_torch


def brute_force(q, k_cache, v_cache, tables, q_lens, kv_lens, block_size, scale, causal):
    out, row = torch.zeros_like(q), 0
    for table, n_q, n_k in zip(tables, q_lens, kv_lens):
        if n_q and n_k:
            slots = [table[p // block_size] * block_size + p % block_size for p in range(n_k)]
            keys, values = k_cache[slots], v_cache[slots]  # [n_k, Hkv, D]
            rep = q.shape[1] // k_cache.shape[1]
            keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
            for i in range(n_q):
                seen = n_k - n_q + i + 1 if causal else n_k
                w = torch.softmax(torch.einsum("hd,khd->hk", q[row + i], keys[:seen]) * scale, dim=-1)
                out[row + i] = torch.einsum("hk,khd->hd", w, values[:seen])
        row += n_q
    return out


def metadata(tables, q_lens, kv_lens, block_size, causal):
    width = max(1, *(len(t) for t in tables))
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)  # -1: no block there
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(backend="paged_torch", slot_mapping=torch.zeros(0, dtype=torch.long), num_seqs=len(q_lens),
                             max_q=max(q_lens), max_k=max(kv_lens), cu_q=cu, block_tables=bt,
                             kv_lens=torch.tensor(kv_lens, dtype=torch.int32), causal=causal, block_size=block_size)


@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 3]))
    causal = draw(st.booleans())
    reqs = draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), min_size=1, max_size=6))
    # a request's queries are its last keys: q_len <= kv_len, or no keys at all (graph padding)
    q_lens = [min(n_q, n_k) if n_k else n_q for n_q, n_k in reqs]
    kv_lens = [n_k for _, n_k in reqs]
    spare = draw(st.integers(0, 3))
    return block_size, hq, hkv, causal, q_lens, kv_lens, spare, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(batches())
def test_matches_attending_one_request_at_a_time(case):
    block_size, hq, hkv, causal, q_lens, kv_lens, spare, seed = case
    g = torch.Generator().manual_seed(seed)
    need = [-(-k // block_size) for k in kv_lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()  # shuffled blocks, 3 spare ones
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    d = 8
    q = torch.randn(sum(q_lens) + spare, hq, d, generator=g, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(len(perm) * block_size, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    got = paged_attention_torch(q, k_cache, v_cache, metadata(tables, q_lens, kv_lens, block_size, causal), 0.3)
    want = brute_force(q, k_cache, v_cache, tables, q_lens, kv_lens, block_size, 0.3, causal)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert not got[sum(q_lens):].any()  # spare rows: zero


def test_rejects_query_starts_past_the_rows():
    meta = metadata([[0]], [3], [3], 4, True)
    with pytest.raises(ValueError, match="query_start ends at 3, past the 2 packed query rows"):
        paged_attention_torch(torch.randn(2, 1, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), meta, 0.3)
