"""Rows of a graphed speculative step that ask for more than the graphs compute: top-k / top-p
filtering, logits rules (penalties, logit_bias, allowed_token_ids, bad_words, min_tokens,
min_p, structured outputs: sample/logits_rules.py), and logprobs.

The verify graphs sample with each request's temperature only: filtering sorts a [rows, vocab]
block, and a rule reads the request's whole history, which every step of every request would pay
inside a graph for the few requests that ask. Until this module such a row sent its step to the
eager speculative step, one eager forward of the target for every request of the batch (~45-50 ms
per step on the H200 for the code-0.6b pair, against ~3 ms graphed: BENCHMARKS.md, run 26's
warm-up log; ruled rows ran at 0.04-0.07x plain on the tiny pair on an H100, runs 46-48), and kept
the step out of the pipeline.

Now the row runs in the graphs with the others, and right after the verify replay, before the read
back is copied out, its part of the step is redone eagerly, on the device, from the verify graph's
final hidden states (GraphedSpecStep.verify_hidden):
- its target distributions p with its rule (position j judged with the drafts before j in its
  history, as the eager step judges it) and its filters (the eager step's SamplingBatch.probs);
- the same drafts, judged against the distributions q they were drawn from (the drafter at the
  request's temperature, without filters or the rule's draft bias: rejection sampling keeps the
  output exactly p for any q, so only the acceptance rate can differ from the eager step, whose
  drafts followed the filters and the rule's additive part);
- the same keyed uniforms (seed and position);
then overwrites the row's tokens, accepted drafts and carry (the next pipelined step's inputs). A
row that only wants logprobs keeps the graph's tokens; the logprobs of the emitted tokens are
computed from the same hidden states and copied out with the read back. A few kernels over the rows
that need them; a row with a rule also needs its drafts on the host (its history at each position,
a grammar's masks), copied out right after the propose replay and waited for while the GPU runs
the verify replay: one more wait in the steps that have such rows, none in the others. Ruled rows
are never pipelined (pipelined.py): their rule needs the previous step's tokens on the host. The
redone rows' accepted drafts count in the engine's statistics and in the adaptive policy's
observations like any row's, although their confidences predict acceptance without the filter or
the rule (only adaptive_verification_online_calibration reads those outcomes back), and a
structured output's drafts past the first one its grammar refuses are verified (and rejected), where
the eager step leaves them out (structured_outputs.grammar_reach).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adaspec.h2d import to_device
from adaspec.sample.batch import SamplingBatch
from adaspec.sample.logits_rules import logits_with_rules, rows_of
from adaspec.sample.probs import logprobs_of
from adaspec.sample.random import SAMPLE, keyed_uniforms, sample_categorical
from adaspec.sample.rejection import rejection_sample


def filters(params) -> bool:
    """top-k or top-p: the row's part of the step is redone with them after the replay."""
    return params.top_p < 1 or params.top_k > 0


def redone(seq) -> bool:
    """Whether a graphed row's part of the step is redone after the replay: filters or a logits rule."""
    return seq.logits_rule is not None or filters(seq.params)


def needs_fix_up(seq) -> bool:
    """Whether a graphed row (an engine Sequence) needs work after the replay (a redo, or logprobs)."""
    return seq.params.logprobs is not None or redone(seq)


@dataclass
class RowExtras:
    """The rows of a graphed launch that need work after the replay, and their parameters."""

    rows: list[int]  # graph rows (indices into the launch's requests) with filters, rules or logprobs
    rows_dev: torch.Tensor  # the same on the device
    want: list[int | None]  # per row: top logprobs wanted (None: none)
    redo: torch.Tensor | None  # positions in `rows` of the rows redone (filters or a rule; device), or None
    redo_rows: torch.Tensor | None  # their graph rows (device)
    batch: SamplingBatch | None  # their sampling parameters (greedy rows at temperature 0)
    ruled: list | None  # the redone rows' Sequences where one has a logits rule (their histories), else None

    @classmethod
    def of(cls, seqs, device) -> "RowExtras | None":
        """From the requests of a graphed launch, in graph row order; None when no row needs it."""
        rows = [r for r, s in enumerate(seqs) if needs_fix_up(s)]
        if not rows:
            return None
        redo = [x for x, r in enumerate(rows) if redone(seqs[r])]
        batch = redo_dev = redo_rows = ruled = None
        if redo:
            picked = [seqs[rows[x]] for x in redo]
            batch = SamplingBatch.build([s.params for s in picked], [s.seed for s in picked], device)
            redo_dev = to_device(redo, device, torch.int64)
            redo_rows = to_device([rows[x] for x in redo], device, torch.int64)
            if any(s.logits_rule is not None for s in picked):
                ruled = picked
        return cls(rows, to_device(rows, device, torch.int64), [seqs[r].params.logprobs for r in rows],
                   redo_dev, redo_rows, batch, ruled)

    @property
    def top_n(self) -> int:
        return max((w or 0 for w in self.want), default=0)

    @property
    def any_logprobs(self) -> bool:
        return any(w is not None for w in self.want)


class DraftsOnHost:
    """The redone rows' drafts and query counts on their way to the host, queued right after the
    propose replay (GraphedSpecStep.launch), so that the host waits for the drafter only while the
    GPU runs the verify replay."""

    def __init__(self, g, extras: RowExtras):
        src = torch.cat([g.drafts[extras.redo_rows], g.nq[extras.redo_rows, None]], 1)  # [F, k + 1]
        cuda = src.device.type == "cuda"
        self.host = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
        self.host.copy_(src, non_blocking=True)
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()

    def get(self) -> tuple[list[list[int]], list[int]]:
        """-> (drafts [F][k], drafts verified [F])."""
        if self.event is not None:
            self.event.synchronize()
        rows = self.host.tolist()
        return [row[:-1] for row in rows], [max(0, row[-1] - 1) for row in rows]


def _verify_logits(g, b: int, q: int, K: int, rows: torch.Tensor) -> torch.Tensor:
    """The target logits of graph rows `rows` (device) at their K + 1 verify positions, from the
    verify graph's hidden states, packed as _verify packed them. -> [len(rows), K + 1, V]."""
    nq_all = g.nq[:b]
    first = (torch.cumsum(nq_all, 0) - nq_all)[rows]  # each row's first token row
    span = torch.arange(K + 1, device=rows.device)
    last = (nq_all[rows] - 1).clamp_min(0)  # a row's verify positions past its last query token repeat it
    packed = (first[:, None] + torch.minimum(span[None, :], last[:, None])).clamp(0, b * q - 1)
    return g.model.compute_logits(g.verify_hidden[packed.reshape(-1)]).view(rows.shape[0], K + 1, -1)


def _with_rules(logits: torch.Tensor, seqs: list, K: int, drafts: DraftsOnHost | None):
    """The redone rows' logits [F, K + 1, V] with their rules, position j with the drafts before it
    in its history, as the eager step judges it (at most the drafts verified; positions after a
    draft a grammar refuses are never reached, and its mask leaves them alone) -> (the logits
    logprobs report: the grammars' masks only; the logits sampled), both [F, K + 1, V]."""
    F, V = logits.shape[0], logits.shape[-1]
    if K == 0:
        before = [[] for _ in seqs]
    else:
        blocks, n_verify = drafts.get()
        before = [blocks[n][:min(j, n_verify[n])] for n in range(F) for j in range(K + 1)]
    row_seqs = [s for s in seqs for _ in range(K + 1)]
    shown, ruled = logits_with_rules(logits.reshape(F * (K + 1), V), rows_of(row_seqs, extras=before))
    return shown.view(F, K + 1, V), ruled.view(F, K + 1, V)


def _redo(g, b: int, K: int, r: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch) -> None:
    """The redone rows r (graph rows, device) of the replayed step: their target distributions
    with their filters (logits: with their rules), the same drafts judged against the distributions
    they were drawn from, the same keyed uniforms; their tokens, accepted drafts and carry overwritten."""
    F = r.shape[0]
    nq, start, seeds = g.nq[:b][r], g.start[r], batch.seeds
    p = batch.probs(logits.reshape(F * (K + 1), -1), repeat=K + 1)
    greedy = batch.temperature <= 0
    rb, carry = g.readback, g.carry
    if K == 0:  # a step that does not draft: the next token only
        drawn = sample_categorical(p, keyed_uniforms(seeds, start + 1, SAMPLE))
        tokens = torch.where(greedy, logits[:, 0].argmax(-1), drawn)
        rb[r, 0] = tokens
        n_acc = torch.zeros_like(start)
        out_tokens = tokens[:, None]
    else:
        accept = getattr(g.drafter, "accept", rejection_sample)  # synthetic: the curve decides, as in the graph
        draft_q = None if g.draft_q is None else g.draft_q[r]
        out = accept(g.drafts[r], (nq - 1).clamp_min(0), p.view(F, K + 1, -1), draft_q, greedy, seeds, start,
                     target_argmax=logits.argmax(-1))
        out_tokens = out.output_tokens
        n_acc = out.num_accepted.long()
        rb[r[:, None], torch.arange(K + 1, device=r.device).unsqueeze(0).expand(F, -1)] = out_tokens
        rb[r, g.k + 1] = n_acc
    carry[r, 0] = out_tokens.gather(1, n_acc[:, None]).squeeze(1)
    carry[r, 1] = start + 1 + n_acc
    carry[r, 2] = n_acc


@torch.inference_mode()
def fix_up(g, b: int, q: int, extras: RowExtras, drafts: DraftsOnHost | None = None):
    """After the verify graph (b, q) was replayed on g (a GraphedSpecStep): redo the rows with
    filters or rules (rows without them keep the graph's tokens, so asking for logprobs changes
    nothing else), then compute the logprobs wanted. drafts: the redone rows' drafts on their way
    to the host (needed when one has a rule and the step drafts). Device work, and for ruled rows
    the wait for their drafts. -> None, or the logprobs at every verify position of the extras rows:
    (chosen [X, K+1], top ids [X, K+1, n], top logprobs [X, K+1, n]) on the device, K = the drafts
    the graph verifies (0 at q = 1)."""
    K = g.k if q > 1 else 0
    logits = _verify_logits(g, b, q, K, extras.rows_dev)  # every extras row needs them (a redo or logprobs)
    if extras.batch is not None:
        r_logits = logits[extras.redo]
        if extras.ruled is not None:
            shown, r_logits = _with_rules(r_logits, extras.ruled, K, drafts)
            if extras.any_logprobs:  # (the logprobs show the grammars' masks only, as vLLM's)
                logits[extras.redo] = shown.to(logits.dtype)
        _redo(g, b, K, extras.redo_rows, r_logits, extras.batch)
    if not extras.any_logprobs:
        return None
    X = len(extras.rows)
    chosen = g.readback[extras.rows_dev, : K + 1].clamp_min(0).reshape(-1)  # the graph's tokens, or the redo's
    c_lp, top_ids, top_lp = logprobs_of(logits.reshape(X * (K + 1), -1), chosen, extras.top_n)
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
