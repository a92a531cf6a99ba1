"""The target model: Qwen3 (Llama with per-head q/k RMSNorm) and Llama.

Parameter names match Hugging Face's Qwen3ForCausalLM / LlamaForCausalLM, so a checkpoint's
state dict loads directly. Two forwards share the layers:
- `forward`: the engine's packed varlen step over the paged KV cache;
- `forward_dense`: a plain causal forward over [B, T] (training, drafter features, tests).
Both can return the hidden states of chosen layers for the drafter ("layer L" = output of
decoder layer L, -1 = embedding output); nothing extra is kept when none are asked for.
"""
from __future__ import annotations

import torch
from torch import nn

from adaspec.models.attention import AttentionMetadata, dense_causal_attention, paged_attention, write_kv
from adaspec.models.config import ModelConfig
from adaspec.models.layers import RMSNorm, RotaryEmbedding, SwiGLU


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        return q, k, v

    def forward(self, x, positions, rope, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv(x, positions, rope)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_dense(self, x, positions, rope):
        q, k, v = self.qkv(x, positions, rope)
        out = dense_causal_attention(q, k, v, self.scale)
        return self.o_proj(out.reshape(*x.shape[:-1], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rope, kv_cache=None, meta=None):
        h = self.input_layernorm(x)
        if meta is None:
            h = self.self_attn.forward_dense(h, positions, rope)
        else:
            h = self.self_attn(h, positions, rope, kv_cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding.from_config(cfg)

    def _run(self, input_ids, positions, capture_layers, kv_caches=None, meta=None):
        x = self.model.embed_tokens(input_ids)
        captured: dict[int, torch.Tensor] = {}
        want = set(capture_layers or ())
        if -1 in want:
            captured[-1] = x
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rope, None if kv_caches is None else kv_caches[i], meta)
            if i in want:
                captured[i] = x
        return self.model.norm(x), captured

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        capture_layers: list[int] | None = None,
    ):
        """Packed step: input_ids/positions [T]. Returns final-normed hidden [T, d] and captured layers."""
        return self._run(input_ids, positions, capture_layers, kv_caches, meta)

    def forward_dense(self, input_ids: torch.Tensor, capture_layers: list[int] | None = None):
        """Causal forward over [B, T] without a cache. Returns hidden, or (hidden, captured) if asked."""
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        hidden, captured = self._run(input_ids, positions, capture_layers)
        return (hidden, captured) if capture_layers is not None else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
