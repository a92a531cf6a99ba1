"""Rows of a graphed speculative step that ask for more than the graphs compute: top-k / top-p
filtering, and logprobs.

The verify graphs sample with each request's temperature only: filtering sorts a [rows, vocab]
block, which every step of every request would pay inside a graph for the few requests that ask.
Until this module such a row sent its step to the eager speculative step, one eager forward of the
target for every request of the batch (~45-50 ms per step on the H200 for the code-0.6b pair,
against ~3 ms graphed: BENCHMARKS.md, run 26's warm-up log), and kept the step out of the pipeline.

Now the row runs in the graphs with the others, and right after the verify replay, before the read
back is copied out, its part of the step is redone eagerly, on the device, from the verify graph's
final hidden states (GraphedSpecStep.verify_hidden):
- its target distributions p with its filters (the eager step's SamplingBatch.probs);
- the same drafts, judged against the distributions q they were drawn from (the drafter at the
  request's temperature, without filters: rejection sampling keeps the output exactly p for any q,
  so only the acceptance rate can differ from the eager step, whose drafts were filtered too);
- the same keyed uniforms (seed and position), so a row that filters nothing gets the tokens the
  graph gave it;
then overwrites the row's tokens, accepted drafts and carry (the next pipelined step's inputs), and
computes the logprobs of the emitted tokens from the same logits, copied out with the read back.
A few kernels over the rows that need them, nothing read back to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adaspec.h2d import to_device
from adaspec.sample.batch import SamplingBatch
from adaspec.sample.probs import logprobs_of
from adaspec.sample.random import SAMPLE, keyed_uniforms, sample_categorical
from adaspec.sample.rejection import rejection_sample


def needs_fix_up(params) -> bool:
    """Whether a graphed row's part of the step must be redone after the replay."""
    return params.logprobs is not None or params.top_p < 1 or params.top_k > 0


@dataclass
class RowExtras:
    """The rows of a graphed launch that need the fix-up, and their sampling parameters."""

    rows: list[int]  # graph rows (indices into the launch's requests)
    rows_dev: torch.Tensor  # the same on the device
    batch: SamplingBatch  # their parameters, greedy rows at temperature 0
    want: list[int | None]  # top logprobs each row asks for (None: none)

    @classmethod
    def of(cls, seqs, device) -> "RowExtras | None":
        """From the requests of a graphed launch, in graph row order; None when no row needs it."""
        rows = [r for r, s in enumerate(seqs) if needs_fix_up(s.params)]
        if not rows:
            return None
        picked = [seqs[r] for r in rows]
        batch = SamplingBatch.build([s.params for s in picked], [s.seed for s in picked], device)
        return cls(rows, to_device(rows, device, torch.int64), batch, [s.params.logprobs for s in picked])

    @property
    def top_n(self) -> int:
        return max((w or 0 for w in self.want), default=0)

    @property
    def any_logprobs(self) -> bool:
        return any(w is not None for w in self.want)


@torch.inference_mode()
def fix_up(g, b: int, q: int, extras: RowExtras):
    """Redo the extras rows' acceptance in the verify graph (b, q) just replayed on g (a
    GraphedSpecStep), with their filters. Device work only. -> None, or the logprobs of every
    verify position of those rows when some row wants them: (chosen [X, K+1], top ids [X, K+1, n],
    top logprobs [X, K+1, n]) on the device, K = the drafts the graph verifies (0 at q = 1)."""
    K = g.k if q > 1 else 0
    r = extras.rows_dev
    X = len(extras.rows)
    nq_all = g.nq[:b]
    first = (torch.cumsum(nq_all, 0) - nq_all)[r]  # each row's first token row, as the graph packed them
    nq, start, seeds = nq_all[r], g.start[r], extras.batch.seeds
    span = torch.arange(K + 1, device=r.device)
    rows = (first[:, None] + torch.minimum(span[None, :], (nq - 1).clamp_min(0)[:, None])).clamp(0, b * q - 1)
    logits = g.model.compute_logits(g.verify_hidden[rows.reshape(-1)])  # [X * (K + 1), V]
    p = extras.batch.probs(logits, repeat=K + 1)
    greedy = extras.batch.temperature <= 0
    rb, carry = g.readback, g.carry
    if K == 0:  # a step that does not draft: the next token only
        drawn = sample_categorical(p, keyed_uniforms(seeds, start + 1, SAMPLE))
        tokens = torch.where(greedy, logits.argmax(-1), drawn)
        rb[r, 0] = tokens
        n_acc = torch.zeros_like(start)
        out_tokens = tokens[:, None]
    else:
        accept = getattr(g.drafter, "accept", rejection_sample)  # synthetic: the curve decides, as in the graph
        draft_q = None if g.draft_q is None else g.draft_q[r]
        out = accept(g.drafts[r], (nq - 1).clamp_min(0), p.view(X, K + 1, -1), draft_q, greedy, seeds, start,
                     target_argmax=logits.argmax(-1).view(X, K + 1))
        out_tokens = out.output_tokens
        n_acc = out.num_accepted.long()
        cols = span.unsqueeze(0).expand(X, -1)
        rb[r[:, None], cols] = out_tokens
        rb[r, g.k + 1] = n_acc
    carry[r, 0] = out_tokens.gather(1, n_acc[:, None]).squeeze(1)
    carry[r, 1] = start + 1 + n_acc
    carry[r, 2] = n_acc
    if not extras.any_logprobs:
        return None
    chosen = out_tokens.clamp_min(0).reshape(-1)
    c_lp, top_ids, top_lp = logprobs_of(logits, chosen, extras.top_n)
    return c_lp.view(X, K + 1), top_ids.view(X, K + 1, -1), top_lp.view(X, K + 1, -1)


def add_logprobs(results: list, extras: RowExtras, logprobs) -> None:
    """Put OpenAI-style logprob dicts (the top-n plus the chosen token, as the eager step gives
    them) on the emitted tokens of the extras rows that want them. logprobs: fix_up's three arrays,
    on the host. results[r] = (tokens, None) per graph row; rows with no tokens (a request that
    ended while the step was in flight) stay as they are."""
    c_lp, top_ids, top_lp = (a.tolist() for a in logprobs)
    for x, (r, w) in enumerate(zip(extras.rows, extras.want)):
        emitted = results[r][0]
        if w is None or not emitted:
            continue
        results[r] = (emitted, [{**dict(zip(top_ids[x][j][:w], top_lp[x][j][:w])), emitted[j]: c_lp[x][j]}
                                for j in range(len(emitted))])
