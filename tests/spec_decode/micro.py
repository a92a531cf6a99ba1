"""A micro speculative 'engine' over a Markov target, for sampler-level losslessness tests.

Target: next-token law P[prev]; drafter: Q[prev] (deliberately poor); conditional confidence
of slot j: C[x_{j-1}] (depends on the previous token, as in DSpark). Each step drafts K tokens
for all rows, asks ``lengths_fn`` how many to verify, accepts with a sampler, and appends the
emitted tokens, until every row has ``length`` tokens. Also the broken samplers (test-only).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from adaspec.sample.rejection import rejection_sample


def sample_rows(probs: torch.Tensor) -> torch.Tensor:
    """Test-side categorical draw from torch's global generator."""
    return torch.multinomial(probs, 1).squeeze(-1)


def broken_sampler(variant: str) -> Callable:
    """Sampler with rejection_sample's signature. 'correct' is the product code; the others are
    deliberately wrong: 'accept_all' accepts every verified draft, 'residual_from_p' samples the
    replacement after a rejection from p instead of normalize(max(p - q, 0))."""
    if variant == "correct":
        return rejection_sample

    def sampler(draft_tokens, num_verify, target_probs, draft_probs, is_greedy, *_, **__):
        N, K = draft_tokens.shape
        p_x = target_probs[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        ok = torch.ones_like(p_x, dtype=torch.bool) if variant == "accept_all" else torch.rand(N, K) * q_x < p_x
        ok &= torch.arange(K)[None, :] < num_verify[:, None]
        n_acc = ok.long().cumprod(1).sum(1)
        p_stop = target_probs[torch.arange(N), n_acc]  # replacement from p: the bug
        final = sample_rows(p_stop)
        out = torch.cat([draft_tokens, torch.full((N, 1), -1)], 1)
        pos = torch.arange(K + 1)[None, :]
        out = torch.where(pos < n_acc[:, None], out, torch.full_like(out, -1))
        out = torch.where(pos == n_acc[:, None], final[:, None], out)
        return out, n_acc, n_acc + 1

    assert variant in ("accept_all", "residual_from_p"), variant
    return sampler


class MicroSpec:
    def __init__(self, P, Q, C, anchor: int, k: int):
        self.P = torch.as_tensor(P, dtype=torch.float32)
        self.Q = torch.as_tensor(Q, dtype=torch.float32)
        self.C = np.asarray(C, dtype=np.float64)
        self.anchor, self.k = anchor, k
        self.length_log: list[np.ndarray] = []

    def exact(self, length: int) -> dict:
        from .lossless_harness import enumerate_joint

        return enumerate_joint(lambda ctx: self.P[ctx[-1] if ctx else self.anchor].tolist(), length)

    def draft(self, anchor: torch.Tensor, deterministic: bool):
        N, K = anchor.shape[0], self.k
        xs, prev = [], anchor
        for _ in range(K):
            q = self.Q[prev]
            prev = q.argmax(-1) if deterministic else sample_rows(q)
            xs.append(prev)
        x = torch.stack(xs, 1)  # [N, K]
        prevs = torch.cat([anchor[:, None], x[:, :-1]], 1)
        q = self.Q[prevs]  # [N, K, V]
        p = self.P[torch.cat([anchor[:, None], x], 1)]  # [N, K+1, V]: p_j given x_<=j
        conf = self.C[prevs.numpy()]  # [N, K], c_j depends on x_{j-1}
        return x, q, p, conf

    def generate(self, n: int, length: int, lengths_fn: Callable, sampler: Callable = rejection_sample,
                 deterministic_draft: bool = False, step_hook: Callable | None = None) -> np.ndarray:
        """lengths_fn(step, conf [n, K] ndarray) -> l [n]; returns tokens [n, length]."""
        out = torch.full((n, length), -1)
        count = torch.zeros(n, dtype=torch.long)
        anchor = torch.full((n,), self.anchor)
        seeds = torch.randint(0, 1 << 62, (n,))  # the sampler's keyed randoms: per row, per position
        step = 0
        while bool((count < length).any()):
            x, q, p, conf = self.draft(anchor, deterministic_draft)
            lv = torch.as_tensor(np.asarray(lengths_fn(step, conf)), dtype=torch.long)
            self.length_log.append(lv.numpy().copy())
            toks, _, n_emit = sampler(x, lv, p, None if deterministic_draft else q, torch.zeros(n, dtype=torch.bool),
                                      seeds, count)  # anchor of row r sits at position count[r]
            for e in range(self.k + 1):
                m = (e < n_emit) & (count + e < length)
                rows = m.nonzero().squeeze(1)
                out[rows, (count + e)[rows]] = toks[rows, e]
            anchor = toks.gather(1, (n_emit - 1)[:, None]).squeeze(1)
            count += n_emit
            if step_hook is not None:
                step_hook(step, conf)
            step += 1
        return out.numpy()
