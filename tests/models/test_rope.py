"""RoPE parameters at real checkpoints' sizes against transformers' own inv_freq, and the errors
a config.json gets for RoPE we do not implement."""
import pytest
import torch

from adaspec.errors import ConfigError
from adaspec.models.config import ModelConfig
from adaspec.models.rope import parse_rope, rope_inv_freq
from adaspec.testing import micro_config

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# head_dim 128 and the published rope settings of Llama 3.1 8B and Qwen3 with YaRN x4
REAL = {
    "llama3.1": (transformers.LlamaConfig, 131072, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}),
    "qwen3-yarn": (transformers.Qwen3Config, 131072, {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 32768}),
}


@pytest.mark.parametrize("name", list(REAL))
def test_inv_freq_and_attention_factor_match_transformers_at_real_sizes(name, tmp_path):
    cls, max_pos, rope = REAL[name]
    hf_cfg = cls(hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=max_pos,
                 rope_parameters=dict(rope))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    hf_cfg.save_pretrained(tmp_path)  # through config.json, as a checkpoint reaches us
    import json

    ours = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    inv, scale = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert torch.allclose(inv.float(), ref_inv, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)
    assert not torch.allclose(inv, rope_inv_freq(128, ours.rope_theta, None)[0])  # the scaling did something


def test_spellings_and_precedence():
    # transformers 4.x: top-level theta, rope_scaling with the old "type" key
    theta, s = parse_rope({"rope_theta": 500000.0, "max_position_embeddings": 4096,
                           "rope_scaling": {"type": "yarn", "factor": 2.0}})
    assert theta == 500000.0 and s == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}
    # a theta inside the dict wins; a top-level original_max_position_embeddings wins (transformers' rule)
    theta, s = parse_rope({"rope_theta": 1.0, "original_max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 7.0, "factor": 2.0, "original_max_position_embeddings": 64}})
    assert theta == 7.0 and s["original_max_position_embeddings"] == 512
    # no RoPE fields at all: plain RoPE with base 10000
    assert parse_rope({}) == (10000.0, None)
    assert parse_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}) == (5e4, None)
    # yarn without a factor (DeepSeek style): the ratio of the context lengths
    assert parse_rope({"max_position_embeddings": 1024, "rope_parameters": {
        "rope_type": "yarn", "original_max_position_embeddings": 256}})[1]["factor"] == 4.0


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "factor": 2.0}, r"rope_type 'longrope' is not supported; adaspec implements "
                                              r"default, llama3, yarn"),
    ({"type": "linear", "factor": 2.0}, r"rope_type 'linear' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, r"rope_type 'llama3' needs low_freq_factor, high_freq_factor"),
    ({"rope_type": "yarn", "factor": "4"}, r"rope parameter factor must be a number, got '4'"),
    ({"rope_type": "default", "rope_theta": "big"}, r"rope parameter rope_theta must be a number"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
    ({"rope_type": ["yarn"]}, r"rope_type \['yarn'\] is not supported"),
    ({"rope_type": "yarn", "original_max_position_embeddings": "64"}, r"original_max_position_embeddings must be"),
])
def test_unsupported_or_broken_rope_is_a_config_error(rope, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(micro_config(rope_parameters=rope))
