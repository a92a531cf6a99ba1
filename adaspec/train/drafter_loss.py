"""One batched drafter pass over many anchors, with the frozen target's features and
distributions, and the DSpark loss (DSPARK.md "Training").

Indexing (slot j = 1..k, stored at index j-1): anchor a; slot j sits at position a+j-1,
predicts token x_{a+j}; its Markov "previous token" is x_{a+j-1} (teacher forcing, x_a is the
anchor); the target's distribution for it is the target's output at position a+j-1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BlockBatch:
    logits: torch.Tensor  # [B, A, k, V] float32 draft logits U_j + B(x_{j-1}) (teacher-forced prev)
    conf_logits: torch.Tensor  # [B, A, k] float32
    target_logits: torch.Tensor  # [B, A, k, V] float32, the target's at the same positions
    tokens: torch.Tensor  # [B, A, k] the true next tokens x_{a+j}


def sample_anchors(B: int, T: int, k: int, A: int, generator: torch.Generator | None = None, low: int = 1) -> torch.Tensor:
    """[B, A] distinct anchors per row in [low, T-1-k] (slot k's target token must exist)."""
    hi = T - k  # exclusive
    n = hi - low
    if n < 1:
        raise ValueError(f"sequence length {T} is too short for block size {k}")
    A = min(A, n)
    scores = torch.rand(B, n, generator=generator)
    return (scores.topk(A, dim=1).indices + low).sort(dim=1).values


def target_features(target, input_ids: torch.Tensor, layer_ids: list[int]):
    """-> (final-normed hidden [B,T,d], concatenated layer features [B,T,m*d])."""
    hidden, captured = target.forward_dense(input_ids, capture_layers=list(layer_ids))
    return hidden, torch.cat([captured[i] for i in layer_ids], dim=-1)


def block_forward(target, drafter, input_ids: torch.Tensor, anchors: torch.Tensor,
                  features: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockBatch:
    """Target (no grad) + drafter over all anchors of the batch. features: the target's
    (final-normed hidden, captured layers) of input_ids when already at hand (train/feature_cache.py)."""
    k = drafter.block_size
    if features is not None:
        hidden_t, feats = features
    else:
        with torch.no_grad():
            hidden_t, feats = target_features(target, input_ids, drafter.config.target_layer_ids)
    B, A = anchors.shape
    pos = anchors.unsqueeze(-1) + torch.arange(k, device=anchors.device)  # [B, A, k]: a+j-1
    flat = pos.reshape(B, A * k)
    prev = input_ids.gather(1, flat).reshape(B, A, k)
    tokens = input_ids.gather(1, flat + 1).reshape(B, A, k)
    with torch.no_grad():
        d = hidden_t.shape[-1]
        th = hidden_t.gather(1, flat.unsqueeze(-1).expand(B, A * k, d))
        target_logits = target.compute_logits(th).reshape(B, A, k, -1).float()
    h = drafter.forward_train(input_ids, feats.detach(), anchors)
    logits, conf = drafter.heads(h, prev)
    return BlockBatch(logits, conf, target_logits, tokens)


def slot_weights(k: int, gamma: float, device=None) -> torch.Tensor:
    """w_j = exp(-(j-1)/gamma), normalized to sum 1."""
    w = torch.exp(-torch.arange(k, device=device, dtype=torch.float32) / gamma)
    return w / w.sum()


def dspark_loss(bb: BlockBatch, gamma: float = 4.0, w_ce: float = 0.1, w_l1: float = 0.9, w_bce: float = 1.0):
    """-> (scalar loss, dict of stat tensors for logging: float_stats turns them into numbers).
    Nothing here reads a tensor back, so a training loop that logs every N steps syncs only then,
    and torch.compile can fuse the whole loss (its [B, A, k, V] float32 passes dominate it)."""
    k = bb.logits.shape[-2]
    logq = torch.log_softmax(bb.logits, dim=-1)
    q = logq.exp()
    p = torch.softmax(bb.target_logits, dim=-1)
    ce = -logq.gather(-1, bb.tokens.unsqueeze(-1)).squeeze(-1)  # [B, A, k]
    l1 = (q - p).abs().sum(-1)
    soft_label = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # analytic acceptance rate 1 - TV
    bce = F.binary_cross_entropy_with_logits(bb.conf_logits, soft_label, reduction="none")
    per_slot = (w_ce * ce + w_l1 * l1 + w_bce * bce).flatten(0, -2).mean(0)  # [k]
    w = slot_weights(k, gamma, per_slot.device)
    loss = (per_slot * w).sum()
    with torch.no_grad():
        stats = {
            "ce": ce.mean(),
            "l1": l1.mean(),
            "bce": bce.mean(),
            "accept": soft_label.flatten(0, -2).mean(0),  # per slot E[min(p,q)] at T=1
            "conf": torch.sigmoid(bb.conf_logits).flatten(0, -2).mean(0),
        }
    return loss, stats


def float_stats(stats: dict[str, torch.Tensor]) -> dict:
    """dspark_loss's stats as numbers: scalars as floats, per-slot ones as lists (one read back)."""
    return {k: v.item() if v.ndim == 0 else v.tolist() for k, v in stats.items()}


def cosine_lr(step: int, total: int, base: float, warmup_frac: float = 0.04) -> float:
    warm = max(1, int(round(total * warmup_frac)))
    if step < warm:
        return base * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))
