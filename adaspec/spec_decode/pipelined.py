"""Pipelined speculative steps (async scheduling with speculation): step t + 1 is scheduled and
launched before step t is read back, so the host's work on step t (its read back, stop checks,
detokenization, outputs, the next schedule) runs while the GPU runs step t + 1.

On the H200 a synchronous speculative step of 256 requests took ~16.5 ms of wall time for ~11 ms
of GPU work (BENCHMARKS.md, run 12): the GPU waited for the host between steps.

What the host does not know when it launches step t + 1 is how many drafts step t accepted, so:
- a request of step t's graphed part ("carried") takes its last token and that token's position
  on the device, from the carry that step t's verify graph wrote (graphed_step.py), and its draft
  slots are capped there at its remaining tokens (max_tokens, max_model_len) less step t's accepted
  drafts; the scheduler counts one certain token of step t and grows its KV blocks as if every
  draft were accepted (Scheduler._running_need), so nothing the device decides lacks a slot;
- a request whose prefill chunk sampled its first token in step t holds a PENDING placeholder for
  it (engine/async_step.py) and takes it in step t + 1 on the device, from step t's sampled tokens;
- a request that step t ends (EOS, a stop token or string, max_tokens) was already launched in
  step t + 1: that row is computed and thrown away, as vLLM's async scheduling pays
  (EngineStats.num_discarded_rows);
- no preemption while a step is in flight (the scheduler raises DrainFirst): the engine reads step
  t back first and schedules again, and so it does for a step with more decoding rows than the
  graphs hold, which runs synchronously (rows with logprobs or top-k / top-p stay in the graphs:
  graphed_extras.py), and for a step with a decoding row that has a logits rule (its rule reads
  the request's history on the host: such a step runs synchronously, in the graphs).
Greedy outputs equal a synchronous engine's, token for token; seeded sampled outputs keep their
distribution (the adaptive policy plans from confidences one step older, so its budgets differ).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from adaspec.engine.async_step import PENDING, InFlightStep
from adaspec.engine.scheduler import ScheduledSeq


@dataclass
class InFlightSpecStep:
    """A launched speculative step whose tokens are still on their way to the host."""

    serial: int  # Sequence.in_flight_step of its requests (engine-wide counter, from 1)
    scheduled: list[ScheduledSeq]
    graphed: list[int]  # indices into scheduled of the rows its graphs run, in graph row order
    finish_graphed: Callable[[], list] | None  # -> (tokens, None) per graphed row, read back
    prefill: InFlightStep | None  # the sampled tokens of its prefill rows that sample
    prefill_rows: list[int]  # indices into scheduled of those rows, in prefill.seqs order
    launched_at: float  # perf_counter at launch: the policy's step time is launch to launch
    # measured step costs (policy.planned_step_kind): (kind, requests) when the step is one to time,
    # and whether it was launched behind the previous step (the GPU ran it right after that one)
    cost_kind: tuple[str, int] | None = None
    behind: bool = False

    def graph_row(self) -> dict[int, int]:
        """id(seq) -> its row in the graphed part (and in the graphs' carry)."""
        return {id(self.scheduled[i].seq): r for r, i in enumerate(self.graphed)}


def carried_rows(rows: list[ScheduledSeq], prev: InFlightSpecStep):
    """What the graphed rows of a step take from `prev`, the step still in flight, on the device:
    -> (carried: (rows, their rows in prev's graphs, remaining) or None,
        first_tokens: (rows, their rows in prev's sampled prefill tokens, those tokens) or None)."""
    graph_row = prev.graph_row() if prev.graphed else {}
    sampled_row = {id(q): j for j, q in enumerate(prev.prefill.seqs)} if prev.prefill is not None else {}
    carried, first = ([], [], []), ([], [])
    for r, s in enumerate(rows):
        seq = s.seq
        if seq.in_flight_max > 0:
            carried[0].append(r)
            carried[1].append(graph_row[id(seq)])
            carried[2].append(s.remaining)
        elif seq.token_ids[-1] == PENDING:
            j = sampled_row.get(id(seq))
            if j is None:
                raise RuntimeError(f"request {seq.request_id}: a placeholder token that the step in flight will "
                                   "not fill (pipelined bookkeeping is broken)")
            first[0].append(r)
            first[1].append(j)
    return (carried if carried[0] else None,
            (first[0], first[1], prev.prefill.tokens) if first[0] else None)


def pipelinable(scheduled: list[ScheduledSeq], covered, max_graph_rows: int) -> bool:
    """Every row is either one the graphs serve (covered) or a prefill chunk, and the graphs
    hold every covered row."""
    n_graphed = 0
    for s in scheduled:
        if covered(s):
            n_graphed += 1
        elif s.seq.is_decoding:
            return False
    return n_graphed <= max_graph_rows
