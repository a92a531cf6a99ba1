"""Slice a loaded model into rank `rank`'s shard of `size` (Megatron-style), in place.

Attention: q heads split evenly; KV heads split when size divides them, else replicated (each
rank keeps the one KV head its q heads read, as vLLM does when size exceeds the KV heads);
q/k/v are column-parallel (rows of the weight), o_proj row-parallel (its input columns) with
one all-reduce. MLP: gate/up column-parallel, down_proj row-parallel with one all-reduce.
Embedding and LM head: vocabulary-parallel (layers.py). Norms, RoPE and, in the drafter, fc,
the Markov and confidence heads stay whole on every rank.

Works on meta tensors too (dummy weights are sharded before they are materialized) and on
already-fused projections (the fused weight is rebuilt from the sliced ones)."""
from __future__ import annotations

from torch import nn

from adaspec.distributed.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from adaspec.errors import ConfigError


def check_shardable(cfg, size: int, what: str = "the model") -> None:
    """ConfigError unless `size` ranks can split cfg's heads and MLP evenly."""
    hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if hq % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the {hq} attention heads of {what}; "
                          f"use a divisor of {hq}")
    if hkv % size and size % hkv:
        raise ConfigError(f"tensor_parallel_size={size} neither divides nor is a multiple of the {hkv} KV heads "
                          f"of {what}")
    if inter % size:
        raise ConfigError(f"tensor_parallel_size={size} does not divide the intermediate size {inter} of {what}")


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    return max(1, num_kv_heads // size)


def _column(linear: nn.Linear, start: int, stop: int) -> nn.Linear:
    """Output rows [start, stop) of a Linear."""
    new = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None, device="meta")
    new.weight = nn.Parameter(linear.weight.detach()[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach()[start:stop].clone(), requires_grad=False)
    return new


def _row(linear: nn.Linear, start: int, stop: int, group) -> RowParallelLinear:
    """Input columns [start, stop) of a Linear, with the all-reduce after it."""
    return RowParallelLinear(linear.weight.detach()[:, start:stop], linear.bias, group)


def shard_attention(attn, rank: int, size: int, group) -> None:
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    fused = attn.qkv_weight is not None
    q_local, kv_local = hq // size, local_kv_heads(hkv, size)
    q0 = rank * q_local
    kv0 = rank * kv_local if hkv >= size else rank * hkv // size  # the KV head of this rank's q heads
    attn.q_proj = _column(attn.q_proj, q0 * d, (q0 + q_local) * d)
    attn.k_proj = _column(attn.k_proj, kv0 * d, (kv0 + kv_local) * d)
    attn.v_proj = _column(attn.v_proj, kv0 * d, (kv0 + kv_local) * d)
    attn.o_proj = _row(attn.o_proj, q0 * d, (q0 + q_local) * d, group)
    attn.num_heads, attn.num_kv_heads = q_local, kv_local
    if fused:
        attn.qkv_weight = attn.qkv_bias = None
        attn.fuse()


def shard_mlp(mlp, rank: int, size: int, group) -> None:
    inter = mlp.gate_proj.out_features // size
    lo, hi = rank * inter, (rank + 1) * inter
    fused = mlp.gate_up_weight is not None
    mlp.gate_proj = _column(mlp.gate_proj, lo, hi)
    mlp.up_proj = _column(mlp.up_proj, lo, hi)
    mlp.down_proj = _row(mlp.down_proj, lo, hi, group)
    if fused:
        mlp.gate_up_weight = None
        mlp.fuse()


def shard_layers(layers, rank: int, size: int, group) -> None:
    for layer in layers:
        shard_attention(layer.self_attn, rank, size, group)
        shard_mlp(layer.mlp, rank, size, group)


def vocab_shard(weight, rank: int, size: int):
    """-> (rows of rank's shard padded with zeros to ceil(V / size), first id, number of real rows)."""
    vocab = weight.shape[0]
    per = -(-vocab // size)
    start = min(rank * per, vocab)
    stop = min(start + per, vocab)
    w = weight.detach()[start:stop]
    if stop - start < per:
        w = nn.functional.pad(w, (0, 0, 0, per - (stop - start)))
    return w, start, stop - start


def shard_vocab(owner, embed_name: str, head_name: str, rank: int, size: int, group, tied: bool) -> None:
    """owner.<embed_name> -> VocabParallelEmbedding; owner-of-head's lm_head -> ParallelLMHead."""
    embed_owner, embed_attr = _resolve(owner, embed_name)
    head_owner, head_attr = _resolve(owner, head_name)
    embed = getattr(embed_owner, embed_attr)
    w, start, valid = vocab_shard(embed.weight, rank, size)
    new_embed = VocabParallelEmbedding(w, start, valid, group)
    setattr(embed_owner, embed_attr, new_embed)
    head = getattr(head_owner, head_attr)
    vocab = head.weight.shape[0]
    if tied:
        new_head = ParallelLMHead(w[:0], vocab, group, size)  # placeholder weight, tied just below
        new_head.weight = new_embed.weight
    else:
        new_head = ParallelLMHead(vocab_shard(head.weight, rank, size)[0], vocab, group, size)
    setattr(head_owner, head_attr, new_head)


def _resolve(root, dotted: str):
    *path, attr = dotted.split(".")
    for p in path:
        root = getattr(root, p)
    return root, attr


def shard_target(model, rank: int, size: int, group) -> None:
    """TargetModel (models/target.py) in place."""
    check_shardable(model.config, size, "the target")
    shard_layers(model.model.layers, rank, size, group)
    shard_vocab(model, "model.embed_tokens", "lm_head", rank, size, group, model.config.tie_word_embeddings)


def shard_drafter(drafter, rank: int, size: int, group) -> None:
    """DSparkDrafter (models/drafter.py) in place: its backbone layers, embedding and LM head
    (copies of the target's, never tied to each other)."""
    check_shardable(drafter.config.base, size, "the drafter")
    shard_layers(drafter.layers, rank, size, group)
    shard_vocab(drafter, "embed_tokens", "lm_head", rank, size, group, tied=False)
