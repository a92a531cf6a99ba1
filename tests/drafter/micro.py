"""Micro models with something to learn, for drafter tests on a CPU.

The "language" is a first-order Markov chain over S states: half the states have one
successor (near-deterministic), the rest spread over a few successors. A micro target is
trained on it for a few seconds, so its distributions are peaked in some places and flat in
others, and a drafter's acceptance varies in a way its confidence head can learn.
"""
from __future__ import annotations

import torch

FIRST, S, FANOUT = 4, 40, 5  # token ids FIRST..FIRST+S-1 (0..3 are special tokens)
MASK_ID = 1


def chain_transitions(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    P = torch.zeros(S, S)
    for s in range(S):
        succ = torch.randperm(S, generator=g)[:FANOUT]
        if s % 2 == 0:
            P[s, succ[0]] = 0.97
            P[s, succ[1:]] = 0.03 / (FANOUT - 1)
        else:
            P[s, succ] = torch.rand(FANOUT, generator=g) + 0.5
            P[s] /= P[s].sum()
    return P


def chain_sequences(n: int, length: int, seed: int = 0, P: torch.Tensor | None = None) -> torch.Tensor:
    P = chain_transitions() if P is None else P
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, S, (n,), generator=g)
    for t in range(1, length):
        x[:, t] = torch.multinomial(P[x[:, t - 1]], 1, generator=g).squeeze(-1)
    return x + FIRST


def train_micro_target(path, steps: int = 60, seed: int = 0):
    """A micro Qwen3 target trained briefly on the chain; returns (model, cfg) in eval mode."""
    from adaspec.models.loader import load_target, save_pretrained
    from adaspec.testing import make_micro_model_dir

    torch.manual_seed(seed)
    make_micro_model_dir(path, seed=seed, init_std=0.02)
    model, cfg = load_target(path)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = chain_sequences(512, 33, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = data[torch.randint(0, data.shape[0], (32,), generator=g)]
        logits = model.compute_logits(model.forward_dense(ids[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model, cfg, path)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg


def random_drafter(target_cfg, block_size: int = 4, layers: int = 2, rank: int = 8, seed: int = 0, target=None,
                   layer_ids=None):
    """A drafter with random (non-trivial) weights, for shape and equivalence tests."""
    from adaspec.models.drafter import DrafterConfig, DSparkDrafter

    cfg = DrafterConfig.from_target(target_cfg, mask_token_id=MASK_ID, block_size=block_size, num_layers=layers,
                                    markov_rank=rank, target_layer_ids=layer_ids or [0, 1])
    torch.manual_seed(seed)
    d = DSparkDrafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(0.1 * torch.randn(p.shape))
        if target is not None:
            d.copy_from_target(target)
    return d.eval(), cfg
