"""ModelConfig: the subset of a Hugging Face Qwen3 / Llama config.json that the model uses."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adaspec.errors import ModelLoadError
from adaspec.models.rope import parse_rope

# HF architecture name -> our family. Qwen3 = Llama + per-head q/k RMSNorm.
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}


@dataclass
class ModelConfig:
    architecture: str  # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope_type + its parameters (models/rope.py) for scaled RoPE (llama3, yarn); None: plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # everything else from config.json, written back unchanged by to_hf()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            mt = d.get("model_type")
            family = {"qwen3": "qwen3", "llama": "llama"}.get(mt)
        if family is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or d.get('model_type')!r}; "
                f"adaspec supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_theta, rope_scaling = parse_rope(d)  # ConfigError naming an unsupported rope type
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            cfg = cls(
                architecture=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                extra=dict(d),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a field of the wrong type: {e}") from None
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_key_value_heads})"
            )
        return cfg

    def to_hf(self) -> dict[str, Any]:
        d = dict(self.extra)
        hf_arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[self.architecture]
        d.update(
            architectures=[hf_arch],
            model_type=self.architecture,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            hidden_act="silu",
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        d.pop("extra", None)
        # RoPE in both spellings: transformers 5 reads rope_parameters, 4.x rope_theta + rope_scaling
        d["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        d.pop("rope_scaling", None)
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d
