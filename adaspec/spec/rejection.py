"""Lossless acceptance of drafted tokens (speculative rejection sampling), vectorized in torch.

Everything stays on the tensors' device and returns tensors: no device-to-host sync. The only
host loop is over rows that carry their own ``torch.Generator`` (seeded requests), each of
which draws its own randoms so a request's output does not depend on its batch neighbours.

Randomness per probabilistic row and step: K uniforms for the accept tests, then ONE
categorical draw (residual after a rejection, or the bonus token) by an exponential race,
``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. per vocabulary entry, which picks index i
with probability probs[i] / sum(probs) without normalizing or a CDF search.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

Generators = Sequence["torch.Generator | None"] | None


def _has_gen(generators: Generators) -> bool:
    return generators is not None and any(g is not None for g in generators)


def exponential_noise(shape: tuple[int, int], generators: Generators, device, dtype=torch.float32) -> torch.Tensor:
    """Exp(1) noise [M, V]; rows with a generator use it, the rest share one batched draw."""
    noise = torch.empty(shape, device=device, dtype=dtype)
    if not _has_gen(generators) or any(g is None for g in generators):
        noise.exponential_()
    if _has_gen(generators):
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
    # exponential_ can return exactly 0 on some backends: 0/0 would be NaN and win argmax
    return noise.clamp_min_(torch.finfo(dtype).tiny)


def uniform_noise(shape: tuple[int, int], generators: Generators, device, dtype=torch.float32) -> torch.Tensor:
    """U[0,1) noise [M, K] with the same per-row generator rule as :func:`exponential_noise`."""
    u = torch.empty(shape, device=device, dtype=dtype)
    if not _has_gen(generators):
        return u.uniform_()
    if any(g is None for g in generators):
        u.uniform_()
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    return u


def sample_rows(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """One categorical sample per row of ``probs`` [M, V] (unnormalized weights are fine).

    ``generators``: None, or a list of M entries (``torch.Generator`` or None = default
    generator). Used for normal (non-speculative) sampling too. An all-zero row returns 0.
    """
    noise = exponential_noise(tuple(probs.shape), generators, probs.device, torch.float32)
    return (probs.float() / noise).argmax(dim=-1)


class RejectionOutput(NamedTuple):
    output_tokens: torch.Tensor  # [N, K+1] long: accepted drafts, then the recovered/bonus token, -1 padding
    num_accepted: torch.Tensor  # [N] long, accepted drafts in 0..l_r
    num_emitted: torch.Tensor  # [N] long, num_accepted + 1


def rejection_sample(
    draft_tokens: torch.Tensor,
    num_verify: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    generators: Generators = None,
    uniforms: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
) -> RejectionOutput:
    """Accept drafts left to right so the emitted tokens follow the target exactly.

    Args:
        draft_tokens: [N, K] drafted tokens; entries at j >= num_verify[n] are ignored.
        num_verify:   [N] l_r in 0..K, how many drafts of row n are verified.
        target_probs: [N, K+1, V] processed target distributions p (temperature/top-p/top-k
                      applied); position j judges draft j, position l_r gives the bonus.
                      Positions > l_r are ignored (may hold anything).
        draft_probs:  [N, K, V] processed draft distributions q, or None: every draft is then
                      treated as deterministic (q = one-hot at the draft, e.g. greedy drafting),
                      which accepts with prob p(x) and resamples from p with x removed.
        is_greedy:    [N] bool. Greedy rows accept x_j iff x_j == argmax p_j and emit argmax
                      p at the stop position; they consume no randomness.
        generators:   None or N entries (torch.Generator or None) for the rows' randoms.
        uniforms:     optional pre-drawn U[0,1) [N, K] for the accept tests (overrides the
                      generators for that part).
        target_argmax: optional [N, K+1] argmax to use for greedy rows (e.g. from the logits,
                      so ties break exactly as the non-speculative path breaks them).
    Returns:
        RejectionOutput(output_tokens [N, K+1] padded with -1, num_accepted [N], num_emitted [N]).
    """
    N, K = draft_tokens.shape
    dev = target_probs.device
    draft_tokens = draft_tokens.to(dev, non_blocking=True).long()
    num_verify = num_verify.to(dev, non_blocking=True).long().clamp(0, K)
    if generators is not None:  # greedy rows leave their generator untouched
        generators = [None if gr else g for g, gr in zip(generators, _host_bools(is_greedy, generators))]
    is_greedy = is_greedy.to(dev, non_blocking=True).bool()  # host copy allowed: no stream sync
    pos = torch.arange(K, device=dev)
    verified = pos[None, :] < num_verify[:, None]  # [N, K]
    safe_x = torch.where(verified, draft_tokens, torch.zeros_like(draft_tokens))

    if target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)  # [N, K+1]
    target_argmax = target_argmax.to(dev, non_blocking=True).long()
    greedy_ok = safe_x == target_argmax[:, :K]

    # probabilistic accept test: u * q(x) < p(x)  <=>  u < p/q  (p(x) = 0 never accepted)
    p_x = target_probs[:, :K].gather(-1, safe_x[..., None]).squeeze(-1).float()
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, safe_x[..., None]).squeeze(-1).float()
    if uniforms is None:
        uniforms = uniform_noise((N, K), generators, dev)
    prob_ok = uniforms.to(dev, non_blocking=True).float() * q_x < p_x

    ok = torch.where(is_greedy[:, None], greedy_ok, prob_ok) & verified
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)  # length of the accepted prefix
    rejected = num_accepted < num_verify  # stopped by a rejection, else bonus

    # the one distribution each row samples from: p at the stop position, minus q if rejected
    idx = num_accepted.view(N, 1, 1).expand(N, 1, target_probs.shape[-1])
    p_stop = target_probs.gather(1, idx).squeeze(1).float()
    stop_k = num_accepted.clamp(max=max(K - 1, 0))  # only used where rejected (so < K)
    if K == 0:
        q_stop = torch.zeros_like(p_stop)
    elif draft_probs is None:
        q_stop = torch.zeros_like(p_stop).scatter_(1, safe_x.gather(1, stop_k.view(N, 1)), 1.0)
    else:
        qidx = stop_k.view(N, 1, 1).expand(N, 1, draft_probs.shape[-1])
        q_stop = draft_probs.gather(1, qidx).squeeze(1).float()
    residual = (p_stop - q_stop).clamp_min(0.0)
    # all-zero residual (p <= q everywhere, only possible up to rounding): fall back to p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_stop)
    dist = torch.where(rejected[:, None], residual, p_stop)

    sampled = sample_rows(dist, generators)
    greedy_tok = target_argmax.gather(1, num_accepted.view(N, 1)).squeeze(1)
    final = torch.where(is_greedy, greedy_tok, sampled)

    out_pos = torch.arange(K + 1, device=dev)
    drafts_pad = torch.cat([draft_tokens, torch.full((N, 1), -1, dtype=torch.long, device=dev)], dim=1)
    out = torch.where(out_pos[None, :] < num_accepted[:, None], drafts_pad, torch.full_like(drafts_pad, -1))
    out = torch.where(out_pos[None, :] == num_accepted[:, None], final[:, None], out)
    return RejectionOutput(out, num_accepted, num_accepted + 1)


def _host_bools(is_greedy: torch.Tensor, generators) -> list[bool]:
    """Greedy rows skip their generator; only looked at when per-row generators exist.
    This reads is_greedy on the host: pass it as a CPU tensor (the engine knows it from the
    sampling params) to keep the step free of device syncs."""
    if is_greedy.device.type == "cpu":
        return [bool(v) for v in is_greedy.tolist()]
    return [False] * len(generators)  # on device: do not sync, just draw (harmless for greedy)
