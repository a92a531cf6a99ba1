"""Qwen3 shapes for timing with load_format="dummy" (random weights, no download): their
published config.json dimensions, written to a directory the engine (and transformers) can load."""
from __future__ import annotations

import json
from pathlib import Path

_COMMON = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "head_dim": 128,
           "num_key_value_heads": 8, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643,
           "eos_token_id": 151645, "torch_dtype": "bfloat16"}

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
    # issue 15's shape
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      tie_word_embeddings=False),
}


def write_shape(name: str, root) -> Path:
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**_COMMON, **SHAPES[name]}, indent=2))
    return out


def write_preset_shape(preset: str, vocab: int, root) -> Path:
    """The target shape of a pair preset (adaspec/train/pair_presets.py), e.g. code-0.6b, with our
    vocabulary of `vocab` tokens, as a config.json-only directory (weights: load_format "dummy")."""
    from adaspec.train.pair_presets import PRESETS

    t = PRESETS[preset]["target"]
    out = write_shape("qwen3-0.6b", root)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(vocab_size=vocab, num_hidden_layers=t["layers"], hidden_size=t["hidden"],
               intermediate_size=t["intermediate"], num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"],
               head_dim=t["head_dim"], max_position_embeddings=t["max_position"], bos_token_id=1, eos_token_id=2)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def param_count(name: str) -> int:
    s = {**_COMMON, **SHAPES[name]}
    d, i, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    hq, hkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    per_layer = d * hd * (hq + 2 * hkv) + hq * hd * d + 3 * d * i + 2 * d + 2 * hd
    return L * per_layer + V * d * (1 if s["tie_word_embeddings"] else 2) + d


def kv_bytes_per_token(name: str, dtype_bytes: int = 2) -> int:
    s = {**_COMMON, **SHAPES[name]}
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * dtype_bytes
