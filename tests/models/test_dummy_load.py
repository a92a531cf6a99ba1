"""load_format="dummy": random weights of the configured shape from a config.json alone."""
import json

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.errors import ConfigError, ModelLoadError
from adaspec.models.loader import load_target


def _config_only_dir(tmp_path):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_dummy_weights_have_the_configured_shape(tmp_path):
    d = _config_only_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_target(d)  # the real loader needs weights
    model, cfg = load_target(d, load_format="dummy")
    assert model.model.embed_tokens.weight.shape == (300, 64) and len(model.model.layers) == 2
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied as configured
    w = model.model.layers[0].mlp.gate_proj.weight
    assert 0.01 < float(w.detach().std()) < 0.03 and float(model.model.norm.weight.detach().min()) == 1.0  # not zeros, not empty
    again, _ = load_target(d, load_format="dummy")
    assert torch.equal(again.model.layers[1].self_attn.q_proj.weight, model.model.layers[1].self_attn.q_proj.weight)


def test_dummy_engine_runs_on_token_ids(tmp_path):
    d = _config_only_dir(tmp_path)
    llm = LLM(str(d), load_format="dummy", skip_tokenizer_init=True, max_num_seqs=4)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_bad_load_format_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="load_format"):
        LLM(str(_config_only_dir(tmp_path)), load_format="pickle")


def test_loading_a_pair_does_not_import_torch_dynamo():
    """Models are built on the meta device, then loaded: an init or table computed there runs
    through torch._refs, whose first call imports torch._dynamo (~2.5 s of CPU in every process that
    loads a model: each server, TP worker and CLI). layers.embedding and RotaryEmbedding skip that
    work on meta; this fails if any meta-time computation comes back."""
    import subprocess
    import sys

    code = ("import sys\nfrom adaspec import LLM\n"
            "LLM('tiny', device='cpu', speculative_config={'method': 'dspark', 'num_speculative_tokens': 3})\n"
            "from adaspec.models.loader import load_target\nload_target('tiny', load_format='dummy')\n"
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False"
