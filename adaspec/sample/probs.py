"""Sampling as pure tensor functions.

`processed_probs` is THE definition of "the distribution a request samples from" (temperature,
then top-k, then top-p). Speculative decoding applies the very same function to the target's
and the drafter's logits, which is what makes rejection sampling lossless for these params.
Greedy rows (temperature 0) get a one-hot distribution on the argmax. Drawing from the
distribution is sample/random.py's job (keyed uniforms, inverse CDF).
"""
from __future__ import annotations

import torch


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    any_filter: bool | None = None,
    any_greedy: bool | None = None,
) -> torch.Tensor:
    """logits [N, V] (float32), temperature/top_p [N] float, top_k [N] long (0 = off) -> probs [N, V].

    any_filter / any_greedy: host-side knowledge of whether any row uses top-k/top-p or is
    greedy; passing them avoids a device->host sync on CUDA.
    """
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t.unsqueeze(-1)
    V = logits.shape[-1]
    needs_k = (top_k > 0) & (top_k < V)
    needs_p = top_p < 1.0
    if any_filter is None:
        any_filter = bool(needs_k.any()) or bool(needs_p.any())
    if any_filter:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=logits.device).unsqueeze(0)
        k = torch.where(needs_k, top_k, torch.full_like(top_k, V)).unsqueeze(-1)
        drop = ranks >= k
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays); only in
        # rows that ask for it: in float32 the running mass reaches 1.0 before the tail ends, which
        # would cut a top_p = 1 row's tail whenever another row of the batch filters
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = drop | ((mass_before >= top_p.unsqueeze(-1)) & needs_p.unsqueeze(-1))
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    probs = torch.softmax(scaled, dim=-1)
    if any_greedy is None:
        any_greedy = bool(greedy.any())
    if any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(-1), onehot, probs)
    return probs


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw model log-probabilities (before temperature), as OpenAI reports them.
    -> (chosen_logprob [N], top_ids [N, top_n], top_logprobs [N, top_n])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n > 0 else (lp[:, :0], chosen[:, None][:, :0])
    return chosen_lp, top_ids, top_lp
