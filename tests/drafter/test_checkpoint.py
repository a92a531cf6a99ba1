"""DeepSpec-compatible checkpoint: exact tensor names and shapes, bit-identical round trip,
optional extras, refusal of a drafter made for another target."""
import json

import pytest
import torch
from safetensors import safe_open

from adaspec.errors import ConfigError
from adaspec.models.drafter import load_drafter, save_drafter, with_temperatures
from adaspec.models.loader import load_target

from .micro import random_drafter


def expected_table(cfg):
    """DSPARK.md's table for this config."""
    b = cfg.base
    V, d, m, r, hd = b.vocab_size, b.hidden_size, len(cfg.target_layer_ids), cfg.markov_rank, b.head_dim
    H, Hkv, I = b.num_attention_heads, b.num_key_value_heads, b.intermediate_size
    t = {"embed_tokens.weight": [V, d], "lm_head.weight": [V, d], "fc.weight": [d, m * d],
         "hidden_norm.weight": [d], "norm.weight": [d],
         "markov_head.markov_w1.weight": [V, r], "markov_head.markov_w2.weight": [V, r],
         "confidence_head.proj.weight": [1, d + r], "confidence_head.proj.bias": [1]}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        t.update({p + "self_attn.q_proj.weight": [H * hd, d], p + "self_attn.k_proj.weight": [Hkv * hd, d],
                  p + "self_attn.v_proj.weight": [Hkv * hd, d], p + "self_attn.o_proj.weight": [d, H * hd],
                  p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
                  p + "mlp.gate_proj.weight": [I, d], p + "mlp.up_proj.weight": [I, d],
                  p + "mlp.down_proj.weight": [d, I],
                  p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d]})
    return t


def test_checkpoint_has_exact_names_and_loads_bit_identically(micro_qwen3, tmp_path):
    target, tcfg = load_target(micro_qwen3)
    drafter, cfg = random_drafter(tcfg, target=target, layers=2)
    save_drafter(drafter, cfg, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == expected_table(cfg)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["tie_word_embeddings"] is False
    for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "num_hidden_layers",
                "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        assert key in hf, key
    assert hf["num_hidden_layers"] == 2 and hf["num_target_layers"] == tcfg.num_hidden_layers
    assert "adaspec" not in hf  # no extras unless calibrated
    loaded, lcfg = load_drafter(tmp_path, target_cfg=tcfg, dtype="float32")
    assert lcfg.confidence_temperatures is None
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_bf16_checkpoint_round_trips(micro_qwen3, tmp_path):
    _, tcfg = load_target(micro_qwen3)
    drafter, cfg = random_drafter(tcfg)
    save_drafter(drafter, cfg, tmp_path, dtype=torch.bfloat16)
    loaded, _ = load_drafter(tmp_path, dtype="bfloat16")
    for k, v in drafter.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), loaded.state_dict()[k]), k


def test_extras_are_optional_and_applied(micro_qwen3, tmp_path):
    _, tcfg = load_target(micro_qwen3)
    drafter, cfg = random_drafter(tcfg, block_size=3)
    temps = [0.5, 1.0, 2.0]
    save_drafter(drafter, with_temperatures(cfg, temps), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["adaspec"]["confidence_temperatures"] == temps
    loaded, lcfg = load_drafter(tmp_path)
    assert lcfg.confidence_temperatures == temps and lcfg.confidence_temperatures_greedy is None
    save_drafter(drafter, with_temperatures(with_temperatures(cfg, temps), [3.0] * 3, greedy=True), tmp_path)
    _, lcfg = load_drafter(tmp_path)
    assert lcfg.confidence_temperatures == temps and lcfg.confidence_temperatures_greedy == [3.0] * 3
    logits = torch.tensor([[1.0, 1.0, 1.0]])
    torch.testing.assert_close(loaded.confidences(logits), torch.sigmoid(logits / torch.tensor(temps)))
    # the same checkpoint as a public one would come: extras gone, unknown keys present
    del hf["adaspec"]
    hf["some_future_field"] = {"x": 1}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded, lcfg = load_drafter(tmp_path)
    assert lcfg.confidence_temperatures is None
    torch.testing.assert_close(loaded.confidences(logits), torch.sigmoid(logits))


def test_refuses_drafter_of_another_target(micro_qwen3, tmp_path):
    _, tcfg = load_target(micro_qwen3)
    drafter, cfg = random_drafter(tcfg)
    save_drafter(drafter, cfg, tmp_path)
    other = type(tcfg).from_hf(dict(tcfg.to_hf(), vocab_size=tcfg.vocab_size + 64))
    with pytest.raises(ConfigError, match="vocab_size"):
        load_drafter(tmp_path, target_cfg=other)
    deeper = type(tcfg).from_hf(dict(tcfg.to_hf(), num_hidden_layers=4))
    with pytest.raises(ConfigError, match="num_target_layers"):
        load_drafter(tmp_path, target_cfg=deeper)
