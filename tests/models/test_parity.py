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
    # the last layer's output (the sum the final norm makes): normed, it is the hidden state
    assert (ours.model.norm(captured[1]) - hidden).abs().max() <= TOL
    with torch.no_grad():
        _, only = ours.forward_dense(ids, capture_layers=[0])
    assert set(only) == {0} and torch.equal(only[0], captured[0])


# ---- RoPE variants: configs written by the installed transformers ----------------------------
# Each case builds its config with transformers' own config class and saves a small random model
# with save_pretrained, so a change in how transformers writes RoPE to config.json fails here.

ROPE_CASES = {
    # a non-default base: transformers 5 writes it inside rope_parameters, not as top-level rope_theta
    "qwen3-theta": ("qwen3", 512, {"rope_type": "default", "rope_theta": 50000.0}),
    # Llama 3.1 scaling; wavelengths of head_dim 16 span all three llama3 bands for original 64
    "llama-llama3": ("llama", 512, {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    "qwen3-yarn": ("qwen3", 256, {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64}),
    # explicit betas and DeepSeek-style mscale pair (attention factor != 0.1 ln(factor) + 1)
    "qwen3-yarn-mscale": ("qwen3", 256, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 2.0,
                                         "beta_slow": 0.25, "mscale": 1.0, "mscale_all_dim": 0.5}),
}
ROPE_SEQ_LEN = 100  # past original_max_position_embeddings (64): the scaled frequencies matter


def hf_rope_model_dir(path, arch, max_positions, rope_parameters, seed=0):
    cls_cfg, cls_model = ((transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if arch == "qwen3"
                          else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    cfg = cls_cfg(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
                  rope_parameters=dict(rope_parameters), initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    cls_model(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(ROPE_CASES))
def rope_model_dir(request, tmp_path_factory):
    arch, max_pos, rope = ROPE_CASES[request.param]
    return hf_rope_model_dir(tmp_path_factory.mktemp(request.param), arch, max_pos, rope)


def _rope_ids(seed=3):
    return torch.randint(0, 300, (ROPE_SEQ_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_rope_variants_dense_match_transformers(rope_model_dir):
    ours, cfg = load_target(rope_model_dir)
    hf = _hf(rope_model_dir)
    ids = torch.tensor([_rope_ids()])
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.compute_logits(ours.forward_dense(ids))
    assert (got - ref).abs().max().item() <= TOL


def test_rope_variants_paged_decode_match_transformers(rope_model_dir):
    """Token-by-token decode through the paged cache up to positions past the original context."""
    ours, cfg = load_target(rope_model_dir)
    hf = _hf(rope_model_dir)
    ids = _rope_ids()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        block_table = list(range(ROPE_SEQ_LEN // 4 + 1))[::-1]
        kv = _kv(cfg, len(block_table) * 4)
        rows = [_paged_forward(ours, cfg, ids[:40], 0, block_table, kv)]
        for i in range(40, len(ids)):
            rows.append(_paged_forward(ours, cfg, ids[i:i + 1], i, block_table, kv))
    assert (torch.cat(rows) - ref).abs().max().item() <= TOL


def test_rope_legacy_spelling_reads_the_same(rope_model_dir, tmp_path):
    """transformers 4.x spelling (top-level rope_theta + rope_scaling) gives the same model as
    transformers 5's rope_parameters, in transformers and in adaspec alike."""
    import json
    import shutil

    legacy = tmp_path / "legacy"
    shutil.copytree(rope_model_dir, legacy)
    d = json.loads((legacy / "config.json").read_text())
    params = dict(d.pop("rope_parameters"))
    d["rope_theta"] = params.pop("rope_theta")
    if params["rope_type"] != "default":
        d["rope_scaling"] = params
    (legacy / "config.json").write_text(json.dumps(d))
    _, new_cfg = load_target(rope_model_dir)
    ours, old_cfg = load_target(legacy)
    assert (old_cfg.rope_theta, old_cfg.rope_scaling) == (new_cfg.rope_theta, new_cfg.rope_scaling)
    ids = torch.tensor([_rope_ids()])
    with torch.no_grad():
        assert (ours.compute_logits(ours.forward_dense(ids)) - _hf(legacy)(ids).logits).abs().max() <= TOL


def test_saved_config_keeps_rope(rope_model_dir, tmp_path):
    """ModelConfig.to_hf writes RoPE so that transformers and adaspec both read it back (from
    the fields alone: `extra`, the copy of the original config.json, is dropped)."""
    from dataclasses import replace

    from adaspec.models.loader import save_pretrained

    ours, cfg = load_target(rope_model_dir)
    cfg = replace(cfg, extra={})
    out = save_pretrained(ours, cfg, tmp_path / "resaved")
    again, cfg2 = load_target(out)
    assert (cfg2.rope_theta, cfg2.rope_scaling) == (cfg.rope_theta, cfg.rope_scaling)
    ids = torch.tensor([_rope_ids()])
    with torch.no_grad():
        assert (again.compute_logits(again.forward_dense(ids)) - _hf(out)(ids).logits).abs().max() <= TOL


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_type_is_refused(rope, tmp_path):
    from adaspec.errors import ConfigError

    path = hf_rope_model_dir(tmp_path, "llama", 256, {"rope_theta": 10000.0, **rope})
    with pytest.raises(ConfigError, match=rf"rope_type '{rope['rope_type']}' is not supported.*default, llama3, yarn"):
        load_target(path)


def test_drafter_uses_the_targets_rope(tmp_path):
    """The drafter's RoPE comes from the same factory: its tables equal the target's."""
    from adaspec.models.drafter import DrafterConfig, DSparkDrafter

    path = hf_rope_model_dir(tmp_path / "t", *ROPE_CASES["qwen3-yarn"])
    target, tcfg = load_target(path)
    dcfg = DrafterConfig.from_target(tcfg, mask_token_id=1, block_size=4)
    again = DrafterConfig.from_hf(dcfg.to_hf())
    assert (again.base.rope_theta, again.base.rope_scaling) == (tcfg.rope_theta, tcfg.rope_scaling)
    drafter = DSparkDrafter(again)
    assert torch.equal(drafter.rope.cos, target.rope.cos) and torch.equal(drafter.rope.sin, target.rope.sin)


def test_rope_variants_greedy_tokens_match_transformers_generate(rope_model_dir):
    """End to end through the engine (the directory has no tokenizer: skip_tokenizer_init), prompts
    long enough that decoding runs past original_max_position_embeddings."""
    from adaspec import LLM, SamplingParams

    hf = _hf(rope_model_dir)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (60, 75, 90)]
    llm = LLM(str(rope_model_dir), skip_tokenizer_init=True, dtype="float32", device="cpu", num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            x = torch.tensor([p])  # an explicit mask: generate would take pad_token_id tokens for padding
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == ref
