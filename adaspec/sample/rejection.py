"""Lossless acceptance of drafted tokens (speculative rejection sampling), vectorized in torch.

Everything stays on the tensors' device and returns tensors: no device-to-host sync, no host
loop over requests. Randomness is keyed (sample/random.py): the accept test of the draft at
position p uses the uniform ACCEPT(seed, p, anchor), and the one categorical draw of the step
(the residual after a rejection, or the bonus token) at position p uses SAMPLE(seed, p), drawn
by inverse CDF from the unnormalized distribution. A row's result therefore depends on its own
inputs only, never on its batch neighbours.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from adaspec.cuda_compiled import cuda_compiled
from adaspec.sample.random import ACCEPT, SAMPLE, keyed_uniforms, keyed_uniforms_eager, sample_categorical


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
    seeds: torch.Tensor,
    anchor_positions: torch.Tensor,
    target_argmax: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    fused: bool = False,
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
                      p at the stop position.
        seeds:        [N] int64 request seeds (sample/random.py).
        anchor_positions: [N] sequence position of each row's anchor (its last verified
                      token): draft j sits at anchor + 1 + j.
        target_argmax: optional [N, K+1] argmax to use for greedy rows (e.g. from the logits,
                      so ties break exactly as the non-speculative path breaks them).
        uniforms:     optional U[0,1) [N, K] for the accept tests instead of the keyed ones.
        fused:        the halves around the one draw as cuda_compiled functions, the keyed hash
                      fused inside them (the graphed verify step, whose capture's warm-up compiles
                      them); else plain ops and keyed_uniforms (the eager paths: a first compile
                      there would stall a request mid-serving). The same values either way.
    Returns:
        RejectionOutput(output_tokens [N, K+1] padded with -1, num_accepted [N], num_emitted [N]).
    """
    dev = target_probs.device
    draft_tokens = draft_tokens.to(dev, non_blocking=True).long()
    num_verify = num_verify.to(dev, non_blocking=True).long()
    is_greedy = is_greedy.to(dev, non_blocking=True).bool()
    seeds = seeds.to(dev, non_blocking=True)
    anchors = anchor_positions.to(dev, non_blocking=True).long()
    if target_argmax is not None:
        target_argmax = target_argmax.to(dev, non_blocking=True).long()
    if uniforms is not None:
        uniforms = uniforms.to(dev, non_blocking=True).float()
    if fused:
        num_accepted, dist, greedy_tok, u_stop = _accept_prefix(draft_tokens, num_verify, target_probs, draft_probs,
                                                                is_greedy, seeds, anchors, target_argmax, uniforms)
        sampled = sample_categorical(dist, u_stop)
        out, num_emitted = _emitted(draft_tokens, num_accepted, is_greedy, greedy_tok, sampled)
    else:
        if uniforms is None:
            K = draft_tokens.shape[1]
            pos = torch.arange(K, device=dev)
            uniforms = keyed_uniforms(seeds, anchors[:, None] + 1 + pos[None, :], ACCEPT, anchors[:, None])
        num_accepted, dist, greedy_tok = _accept_core(draft_tokens, num_verify, target_probs, draft_probs, is_greedy,
                                                      target_argmax, uniforms)
        sampled = sample_categorical(dist, keyed_uniforms(seeds, anchors + 1 + num_accepted, SAMPLE))
        out, num_emitted = _emitted.eager(draft_tokens, num_accepted, is_greedy, greedy_tok, sampled)
    return RejectionOutput(out, num_accepted, num_emitted)


# The two halves around the one categorical draw (a Triton kernel on CUDA) are cuda_compiled for
# the graphed step: as torch ops they were ~45 kernels of a few microseconds each per step.
@cuda_compiled
def _accept_prefix(draft_tokens, num_verify, target_probs, draft_probs, is_greedy, seeds, anchors, target_argmax,
                   uniforms):
    """_accept_core with its keyed uniforms computed inside -> (... its three results, the
    stop position's draw uniform [N])."""
    if uniforms is None:  # the eager hash: inside a compiled function it fuses like any other op
        pos = torch.arange(draft_tokens.shape[1], device=target_probs.device)
        uniforms = keyed_uniforms_eager(seeds, anchors[:, None] + 1 + pos[None, :], ACCEPT, anchors[:, None])
    num_accepted, dist, greedy_tok = _accept_core(draft_tokens, num_verify, target_probs, draft_probs, is_greedy,
                                                  target_argmax, uniforms)
    return num_accepted, dist, greedy_tok, keyed_uniforms_eager(seeds, anchors + 1 + num_accepted, SAMPLE)


def _accept_core(draft_tokens, num_verify, target_probs, draft_probs, is_greedy, target_argmax, uniforms):
    """-> (accepted drafts [N] long, the distribution the stop position samples from [N, V]
    float32 (unnormalized), the greedy rows' token there [N]). uniforms: [N, K] accept tests."""
    N, K = draft_tokens.shape
    dev = target_probs.device
    num_verify = num_verify.clamp(0, K)
    pos = torch.arange(K, device=dev)
    verified = pos[None, :] < num_verify[:, None]  # [N, K]
    safe_x = torch.where(verified, draft_tokens, torch.zeros_like(draft_tokens))

    if target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)  # [N, K+1]
    greedy_ok = safe_x == target_argmax[:, :K]

    # probabilistic accept test: u * q(x) < p(x)  <=>  u < p/q  (p(x) = 0 never accepted)
    p_x = target_probs[:, :K].gather(-1, safe_x[..., None]).squeeze(-1).float()
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, safe_x[..., None]).squeeze(-1).float()
    prob_ok = uniforms * q_x < p_x

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
    greedy_tok = target_argmax.gather(1, num_accepted.view(N, 1)).squeeze(1)
    return num_accepted, dist, greedy_tok


@cuda_compiled
def _emitted(draft_tokens, num_accepted, is_greedy, greedy_tok, sampled):
    """-> (output tokens [N, K+1]: the accepted drafts, then the stop position's token, -1 after;
    tokens emitted [N])."""
    N, K = draft_tokens.shape
    final = torch.where(is_greedy, greedy_tok, sampled)
    out_pos = torch.arange(K + 1, device=draft_tokens.device)
    drafts_pad = torch.cat([draft_tokens, torch.full((N, 1), -1, dtype=torch.long, device=draft_tokens.device)], dim=1)
    out = torch.where(out_pos[None, :] < num_accepted[:, None], drafts_pad, torch.full_like(drafts_pad, -1))
    out = torch.where(out_pos[None, :] == num_accepted[:, None], final[:, None], out)
    return out, num_accepted + 1
