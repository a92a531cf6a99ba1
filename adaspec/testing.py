"""Helpers for tests and examples: tiny random Hugging Face model directories, made offline.

`make_micro_model_dir` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and generation_config.json for a random Qwen3 or Llama model small
enough to run in milliseconds on a CPU. Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]

_SAMPLE_TEXT = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import os\nimport sys\n\nclass Foo(object):\n    def __init__(self, x):\n        self.x = x\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "The quick brown fox jumps over the lazy dog. Hello world! 0123456789",
    "while True:\n    try:\n        value = next(it)\n    except StopIteration:\n        break\n",
]


def make_byte_level_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on a few lines of code: exact round trip for any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_SAMPLE_TEXT * 4, trainer=trainer)
    return tok


def micro_config(arch: str = "qwen3", vocab_size: int = 320, **overrides) -> dict:
    cfg = dict(
        architectures=["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        model_type=arch,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=0,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def make_micro_model_dir(path, arch: str = "qwen3", seed: int = 0, init_std: float = 0.1, **overrides) -> Path:
    """Write a random micro model directory; returns its path. `overrides` edit config.json."""
    import torch

    from adaspec.models.config import ModelConfig
    from adaspec.models.loader import save_pretrained
    from adaspec.models.target import TargetModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_byte_level_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    vocab = max(overrides.pop("vocab_size", 0), tok.get_vocab_size())
    eos_id = tok.token_to_id("<|endoftext|>")
    cfg = ModelConfig.from_hf(micro_config(arch, vocab_size=vocab, eos_token_id=eos_id, **overrides))
    g = torch.Generator().manual_seed(seed)
    model = TargetModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=g))
    save_pretrained(model, cfg, path)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "<|mask|>",
                "model_max_length": cfg.max_position_embeddings,
            },
            indent=2,
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}, indent=2))
    return path
