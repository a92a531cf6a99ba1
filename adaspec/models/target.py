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
import torch.nn.functional as F
from torch import nn

from adaspec.models.attention import AttentionMetadata, dense_causal_attention, paged_attention, write_kv
from adaspec.models.config import ModelConfig
from adaspec.models.fused import fused_kv_write, kv_written_by_kernel, ops, q_with_kv_written
from adaspec.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, embedding, fuse_linears


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
        self.eps = cfg.rms_norm_eps
        self.qkv_weight: torch.Tensor | None = None  # set by fuse()
        self.qkv_bias: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """One [(Hq + 2 Hkv) D, d] projection instead of three (one matmul per step); the q/k/v
        weights become views into it, so the state dict keeps Hugging Face's names."""
        self.qkv_weight, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight) = fuse_linears(
            self.q_proj, self.k_proj, self.v_proj)
        if self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]).detach()

    def projections(self, x: torch.Tensor):
        """-> (q, k, v) per head, before the norms and RoPE."""
        shape = x.shape[:-1]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.reshape(*shape, self.num_heads, self.head_dim), k.reshape(*shape, self.num_kv_heads, self.head_dim),
                v.reshape(*shape, self.num_kv_heads, self.head_dim))

    def kv_projections(self, x: torch.Tensor):
        """-> (k, v) per head, before the norm and RoPE (the drafter's context, which has no
        queries). Fused, one matmul: k's and v's rows are adjacent in qkv_weight."""
        shape = x.shape[:-1]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_weight is not None:
            bias = None if self.qkv_bias is None else self.qkv_bias[nq:]
            k, v = F.linear(x, self.qkv_weight[nq:], bias).split([nkv, nkv], dim=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        return k.reshape(*shape, self.num_kv_heads, self.head_dim), v.reshape(*shape, self.num_kv_heads, self.head_dim)

    def kv_written(self, x, positions, rope: RotaryEmbedding, k_cache, v_cache, slots) -> None:
        """x's keys and values, k normed and rotated, written to the paged cache at `slots`, for
        x without queries (the drafter's context): on CUDA by the layers' Triton kernel with no
        query heads (fused.kv_written_by_kernel), else by the separate ops."""
        k, v = self.kv_projections(x)
        k_weight = self.k_norm.weight if self.k_norm is not None else None
        if not kv_written_by_kernel(k, v, positions, rope.cos, rope.sin, k_weight, self.eps, k_cache, v_cache, slots):
            write_kv(k_cache, v_cache, self.k_normed_rotated(k, positions, rope), v, slots)

    def k_normed_rotated(self, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """Keys without their queries through the k norm (if any) and RoPE, as separate ops."""
        if self.k_norm is not None:
            k = self.k_norm(k)
        (k,) = rope(positions, k)
        return k

    def qk_weights(self):
        return (self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding):
        q, k, v = self.projections(x)
        q, k = ops.qk_norm_rope(q, k, positions, rope.cos, rope.sin, *self.qk_weights(), self.eps)
        return q, k, v

    def q_with_kv_written(self, x, positions, rope: RotaryEmbedding, k_cache, v_cache, slots) -> torch.Tensor:
        """x's queries, after its keys and values went to the paged cache at `slots`: by default
        written by the kernel that norms and rotates them (fused.q_with_kv_written: on CUDA one
        Triton kernel, models/qk_norm_rope_triton.py; with ADASPEC_FUSED_KV_WRITE=1, or where the
        kernel does not apply, the compiled fused.qk_norm_rope_write_kv); ADASPEC_FUSED_KV_WRITE=0
        writes them after RoPE with index_copy_."""
        if fused_kv_write():
            q, k, v = self.projections(x)
            return q_with_kv_written(q, k, v, positions, rope.cos, rope.sin, *self.qk_weights(), self.eps,
                                     k_cache, v_cache, slots)
        q, k, v = self.qkv(x, positions, rope)
        write_kv(k_cache, v_cache, k, v, slots)
        return q

    def forward(self, x, positions, rope, kv_cache, meta: AttentionMetadata):
        k_cache, v_cache = kv_cache
        q = self.q_with_kv_written(x, positions, rope, k_cache, v_cache, meta.slot_mapping)
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

    def forward(self, h, residual, positions, rope, kv_cache=None, meta=None):
        """Residual-stream form: the layer's input is h + residual (residual None: h alone);
        returns (mlp output, residual, input), the first two summing to the layer's output. Each
        residual add is fused into the norm that follows it (fused.add_rms_norm), which makes the
        layer's input anyway: returned, it is the previous layer's output for the drafter's
        features without another add."""
        w_in, w_post = self.input_layernorm.weight, self.post_attention_layernorm.weight
        if residual is None:
            residual, h = h, ops.rms_norm(h, w_in, self.input_layernorm.eps)
        else:
            h, residual = ops.add_rms_norm(h, residual, w_in, self.input_layernorm.eps)
        layer_input = residual
        if meta is None:
            h = self.self_attn.forward_dense(h, positions, rope)
        else:
            h = self.self_attn(h, positions, rope, kv_cache, meta)
        h, residual = ops.add_rms_norm(h, residual, w_post, self.post_attention_layernorm.eps)
        return self.mlp(h), residual, layer_input


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
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

    def fuse_projections(self) -> None:
        """Inference: fused qkv and gate_up projections in every layer (see Attention.fuse)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def _run(self, input_ids, positions, capture_layers, kv_caches=None, meta=None):
        h, residual = self.model.embed_tokens(input_ids), None
        captured: dict[int, torch.Tensor] = {}  # layer -> its output (-1: the embeddings)
        want = set(capture_layers or ())
        for i, layer in enumerate(self.model.layers):
            h, residual, layer_input = layer(h, residual, positions, self.rope,
                                             None if kv_caches is None else kv_caches[i], meta)
            if i - 1 in want:  # layer i's input is layer i - 1's output (layer 0's: the embeddings)
                captured[i - 1] = layer_input
        norm = self.model.norm
        hidden, last_output = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        if len(self.model.layers) - 1 in want:
            captured[len(self.model.layers) - 1] = last_output
        return hidden, captured

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
