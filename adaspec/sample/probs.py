"""Sampling as pure tensor functions.

`processed_probs` is THE definition of "the distribution a request samples from" (temperature,
then top-k, then top-p). Speculative decoding applies the very same function to the target's
and the drafter's logits, which is what makes rejection sampling lossless for these params.
Greedy rows (temperature 0) get a one-hot distribution on the argmax. Drawing from the
distribution is sample/random.py's job (keyed uniforms, inverse CDF). On CUDA, rows without
top-k / top-p run as one Triton kernel (sample/triton_sampling.py, dispatched by
sample/kernels.py), the same function up to float rounding.
"""
from __future__ import annotations

import torch

from adaspec.sample import kernels
from adaspec.sample.random import sample_categorical


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    any_filter: bool | None = None,
    any_greedy: bool | None = None,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [N, V] (float32), temperature/top_p [N] float, top_k [N] long (0 = off) -> probs [N, V].

    any_filter / any_greedy: host-side knowledge of whether any row uses top-k/top-p or is
    greedy; passing them avoids a device->host sync on CUDA.
    index: optional [n] long, the rows of logits to process (output row i is logits row
    index[i]; temperature, top_p and top_k are then per output row): a gather the Triton kernel
    does without copying the logits.
    """
    V = logits.shape[-1]
    if any_filter is None:
        needs_k, needs_p = _filtering_rows(top_k, top_p, V)
        any_filter = bool(needs_k.any()) or bool(needs_p.any())
    if not any_filter and kernels.use_triton(logits):
        return kernels.triton_sampling().probs(logits, temperature, greedy_rows=any_greedy is not False, index=index)
    if index is not None:
        logits = logits[index]
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t.unsqueeze(-1)
    if any_filter:
        needs_k, needs_p = _filtering_rows(top_k, top_p, V)
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


def probs_and_argmax(logits: torch.Tensor, temperature: torch.Tensor,
                     index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(processed_probs without filters, greedy rows one-hot; each output row's first argmax of
    the raw logits [n] long). index as in processed_probs. On CUDA one Triton kernel finds the
    argmax in the pass it makes anyway (the graphed verify step's greedy rows accept by it)."""
    if kernels.use_triton(logits):
        return kernels.triton_sampling().probs_and_argmax(logits, temperature, greedy_rows=True, index=index)
    rows = logits if index is None else logits[index]  # gathered once, for both
    probs = processed_probs(rows, temperature, torch.ones_like(temperature),
                            torch.zeros_like(temperature, dtype=torch.long), any_filter=False, any_greedy=True)
    return probs, rows.argmax(-1)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The next token [N] long of each row of logits [N, V], without filters: a greedy row's
    (temperature <= 0) first argmax of the raw logits; a sampled row's inverse-CDF draw with its
    uniform [N] from softmax(logits / T), i.e. sample_categorical over processed_probs. On CUDA one
    Triton kernel, in which a greedy row costs one read of its logits and no write (a step of greedy
    rows pays for an argmax, not for probabilities it discards)."""
    if kernels.use_triton(logits):
        return kernels.triton_sampling().sample_tokens(logits, temperature, uniforms)
    unfiltered = torch.ones_like(temperature), torch.zeros_like(temperature, dtype=torch.long)
    probs = processed_probs(logits, temperature, *unfiltered, any_filter=False, any_greedy=False)
    return torch.where(temperature <= 0, logits.argmax(-1), sample_categorical(probs, uniforms))


def _filtering_rows(top_k: torch.Tensor, top_p: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose top-k cuts the vocabulary, and those whose top-p is below 1 ([N] bool each)."""
    return (top_k > 0) & (top_k < V), top_p < 1.0


def sample_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
    any_filter: bool,
    any_greedy: bool | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N], probs [N, V]): processed_probs, then one inverse-CDF draw per row with
    uniforms [N] (sample_categorical). out: an optional float32 [N, V] (rows contiguous) to hold
    the probabilities, e.g. a slice of a static buffer (no copy on CUDA). Without filters on CUDA
    one Triton kernel does both, drawing what sample_categorical would draw from its probs."""
    if not any_filter and kernels.use_triton(logits):
        return kernels.triton_sampling().draw_from_logits(logits, temperature, uniforms,
                                                          greedy_rows=any_greedy is not False, out=out)
    probs = processed_probs(logits, temperature, top_p, top_k, any_filter=any_filter, any_greedy=any_greedy)
    if out is not None:
        probs = out.copy_(probs)
    return sample_categorical(probs, uniforms), probs


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw model log-probabilities (before temperature), as OpenAI reports them.
    -> (chosen_logprob [N], top_ids [N, top_n], top_logprobs [N, top_n])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n > 0 else (lp[:, :0], chosen[:, None][:, :0])
    return chosen_lp, top_ids, top_lp
