"""Logits parity with transformers' Qwen3ForCausalLM / LlamaForCausalLM (float32, CPU)."""
import pytest
import torch

from adaspec.models.attention import build_attention_metadata
from adaspec.models.loader import load_target

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(params=["micro_qwen3", "micro_llama"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def _paged_forward(model, cfg, ids, start, block_table, kv, block_size=4):
    meta = build_attention_metadata("reference", [block_table], [len(ids)], [start + len(ids)], None, block_size,
                                    torch.device("cpu"))
    pos = torch.arange(start, start + len(ids))
    hidden, _ = model(torch.tensor(ids), pos, kv, meta)
    return model.compute_logits(hidden)


def _kv(cfg, num_slots):
    from adaspec.engine.kv_cache import allocate_kv_caches

    return allocate_kv_caches(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim,
                              torch.float32, torch.device("cpu"))


def test_dense_prefill_matches_transformers(model_dir):
    ours, _ = load_target(model_dir)
    hf = _hf(model_dir)
    ids = torch.randint(0, 300, (3, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.compute_logits(ours.forward_dense(ids))
    assert (got - ref).abs().max().item() <= TOL


def test_paged_prefill_and_decode_match_transformers(model_dir):
    ours, cfg = load_target(model_dir)
    hf = _hf(model_dir)
    ids = torch.randint(0, 300, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        # full prefill through the paged cache, blocks deliberately out of order
        block_table = [5, 2, 7, 0, 3, 6, 1, 4]
        kv = _kv(cfg, 8 * 4)
        got = _paged_forward(ours, cfg, ids, 0, block_table, kv)
        assert (got - ref).abs().max().item() <= TOL
        # prefill 10 tokens, then token-by-token decode through the cache
        kv = _kv(cfg, 8 * 4)
        rows = [_paged_forward(ours, cfg, ids[:10], 0, block_table, kv)]
        for i in range(10, len(ids)):
            rows.append(_paged_forward(ours, cfg, ids[i:i + 1], i, block_table, kv))
        got = torch.cat(rows)
    assert (got - ref).abs().max().item() <= TOL


def test_mixed_varlen_batch_matches_solo(micro_qwen3):
    """Several requests of different query lengths in ONE packed forward equal their solo runs."""
    ours, cfg = load_target(micro_qwen3)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 17, 1, 9)]
    with torch.no_grad():
        solo = [ours.compute_logits(ours.forward_dense(torch.tensor([s])))[0] for s in seqs]
        kv = _kv(cfg, 32 * 4)
        tables = [[0, 1], [2, 3, 4, 5, 6], [7], [8, 9, 10]]
        # first 3 tokens of each request (or all, if shorter), then the rest in one mixed step
        first = [min(3, len(s)) for s in seqs]
        meta = build_attention_metadata("reference", tables, first, first, None, 4, torch.device("cpu"))
        ids = torch.tensor([t for s, f in zip(seqs, first) for t in s[:f]])
        pos = torch.cat([torch.arange(f) for f in first])
        ours(ids, pos, kv, meta)
        rest = [(s[f:], f) for s, f in zip(seqs, first)]
        keep = [i for i, (r, _) in enumerate(rest) if r]
        meta = build_attention_metadata("reference", [tables[i] for i in keep], [len(rest[i][0]) for i in keep],
                                        [len(seqs[i]) for i in keep], None, 4, torch.device("cpu"))
        ids = torch.tensor([t for i in keep for t in rest[i][0]])
        pos = torch.cat([torch.arange(rest[i][1], len(seqs[i])) for i in keep])
        hidden, _ = ours(ids, pos, kv, meta)
        logits = ours.compute_logits(hidden)
    off = 0
    for i in keep:
        n = len(rest[i][0])
        assert (logits[off:off + n] - solo[i][first[i]:]).abs().max().item() <= TOL
        off += n


def test_capture_layers_returns_chosen_hidden_states(micro_qwen3):
    ours, _ = load_target(micro_qwen3)
    hf = _hf(micro_qwen3)
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        hidden, captured = ours.forward_dense(ids, capture_layers=[-1, 0, 1])
        ref = hf(ids, output_hidden_states=True).hidden_states
    assert set(captured) == {-1, 0, 1}
    assert (captured[-1] - ref[0]).abs().max() <= TOL  # embedding output
    assert (captured[0] - ref[1]).abs().max() <= TOL  # output of decoder layer 0
    # HF's last hidden state is after the final norm
    assert (hidden - ref[-1]).abs().max() <= TOL
