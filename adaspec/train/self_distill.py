"""Continuations sampled from the target itself, for drafter training and offline evaluation.

A plain batched decode loop over the target's own paged forward (one contiguous run of cache
blocks per row), so the samples are exactly the target's distribution and cost one token
per row per step. No stop at EOS: fixed-length rows keep batching trivial, and after an EOS
the target simply starts a new document, which is still its own text.
"""
from __future__ import annotations

import numpy as np
import torch

from adaspec.models.attention import build_attention_metadata


@torch.no_grad()
def sample_continuations(target, prompts: torch.Tensor, gen_len: int, temperature: float = 1.0, top_p: float = 1.0,
                         seed: int = 0, batch_size: int = 256, progress: bool = False) -> torch.Tensor:
    """prompts [N, P] (equal lengths) -> [N, P + gen_len] (prompt then continuation)."""
    out = []
    rng = torch.Generator(device=next(target.parameters()).device).manual_seed(seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=prompts.shape[0], desc="self-distill", unit="seq")
    for i in range(0, prompts.shape[0], batch_size):
        out.append(_sample_batch(target, prompts[i:i + batch_size], gen_len, temperature, top_p, rng))
        if bar:
            bar.update(out[-1].shape[0])
    if bar:
        bar.close()
    return torch.cat(out)


def sample_ragged(target, prompts: list[list[int]], gen_len: int, temperature: float = 1.0, seed: int = 0,
                  batch_size: int = 64) -> list[list[int]]:
    """Prompts of any lengths: grouped by length so each batch is rectangular."""
    device = next(target.parameters()).device
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    res: list[list[int] | None] = [None] * len(prompts)
    for n, (L, idx) in enumerate(sorted(by_len.items())):
        ids = torch.tensor([prompts[i] for i in idx], device=device)
        seqs = sample_continuations(target, ids, gen_len, temperature, seed=seed + n, batch_size=batch_size)
        for i, s in zip(idx, seqs.tolist()):
            res[i] = s
    return res  # type: ignore[return-value]


def _sample_batch(target, prompts, gen_len, temperature, top_p, rng):
    from adaspec.engine.sampler import processed_probs

    cfg = target.config
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    B, P = prompts.shape
    total = P + gen_len
    bs = 16
    nblk = (total + bs - 1) // bs
    tables = [list(range(b * nblk, (b + 1) * nblk)) for b in range(B)]
    caches = [
        (torch.zeros(B * nblk * bs, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype),
         torch.zeros(B * nblk * bs, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    backend = "reference"  # the varlen kernel is an engine concern; this loop must just be right
    seqs = torch.empty(B, total, dtype=torch.long, device=device)
    seqs[:, :P] = prompts.to(device)
    ids, q_len = seqs[:, :P].reshape(-1), P
    temp = torch.full((B,), float(temperature), device=device)
    tp = torch.full((B,), float(top_p), device=device)
    tk = torch.zeros(B, dtype=torch.long, device=device)
    for t in range(P, total):
        kv_len = t
        meta = build_attention_metadata(backend, tables, [q_len] * B, [kv_len] * B, None, bs, device)
        positions = torch.from_numpy(np.tile(np.arange(kv_len - q_len, kv_len), B)).to(device)
        hidden, _ = target(ids, positions, caches, meta)
        last = hidden.view(B, q_len, -1)[:, -1]
        logits = target.compute_logits(last)
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            probs = processed_probs(logits, temp, tp, tk, any_filter=top_p < 1.0, any_greedy=False)
            nxt = torch.multinomial(probs, 1, generator=rng).squeeze(-1)
        seqs[:, t] = nxt
        ids, q_len = nxt, 1
    return seqs.cpu()
