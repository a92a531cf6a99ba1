"""Engine counters: monotonic totals, read between steps (the server turns them into Prometheus)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class EngineStats:
    num_steps: int = 0
    # wall seconds inside step() (host work and waiting for the GPU's read back): against a
    # run's wall time it says how much of the engine loop went to stepping and how much to
    # taking requests and sending news (serve/engine_process.py), or to waiting for work
    time_in_steps: float = 0.0
    num_prompt_tokens: int = 0  # prompt tokens run through the target (recomputes included)
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    # async scheduling: rows computed for requests that had stopped in the step before (wasted)
    num_discarded_rows: int = 0
    # pipelined speculative steps (spec_decode/pipelined.py): steps launched before the previous
    # one was read back, and the times the engine read the step in flight back first instead
    num_pipelined_steps: int = 0
    num_pipeline_drains: int = 0
    # speculative decoding (vLLM's spec_decode counters)
    num_drafts: int = 0  # requests that got a draft proposal in a step
    num_draft_tokens: int = 0  # proposed draft tokens (k per draft)
    num_verified_tokens: int = 0  # drafts the policy sent to verification
    num_accepted_tokens: int = 0
    num_bonus_tokens: int = 0  # tokens sampled from the target (one per verifying request per step)
    # tokens sampled in steps where the request had no draft, kept (a discarded row's is not counted)
    num_sampled_without_draft: int = 0
    num_steps_draft_skipped: int = 0  # adaptive: steps where drafting was predicted not to pay
    # adaptive_verification_mixed_steps "fused": steps with prompt chunks that ran as one forward
    num_mixed_steps_fused: int = 0
    num_capped_draft_slots: int = 0  # proposed slots that could never be verified (near max_tokens)
    # structured outputs: planned slots not verified, past a draft the grammar refuses (certain
    # rejections: the per-position and calibration counts take them as verified and rejected)
    num_grammar_skipped_slots: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    verified_per_pos: list[int] = field(default_factory=list)
    budget_hist: Counter = field(default_factory=Counter)  # B (verified drafts in the step) -> steps
    verify_len_hist: Counter = field(default_factory=Counter)  # l_r -> requests
    # calibration, per slot position: sum of predicted survival of verified slots vs accepted
    predicted_accept_per_pos: list[float] = field(default_factory=list)
    # wall time split (seconds)
    time_draft: float = 0.0
    time_verify: float = 0.0  # the target forward
    time_sample: float = 0.0
    time_bookkeeping: float = 0.0
    # graphed speculative steps (spec_decode/graphed_step.py): propose, verify and accept run as
    # one stretch of GPU work up to the read back, so they are not split into the three above
    time_graphed: float = 0.0
    num_graphed_steps: int = 0
    # the adaptive policy's cost tables checked against the steps it planned (decode-only drafting
    # steps, by query tokens per request, 1 + B / R rounded up; index q - 1): steps, what the tables
    # priced them at, and their measured wall time (launch to launch when pipelined, so the host's
    # share is in it). A wall / priced ratio that grows with q means the tables under-price verifying
    # more drafts, and the policy verifies too many (H200 run 28: at T = 1, 16 requests, adaptive:7
    # verified 6.5 drafts per request in 3.73 ms steps where fixed k = 3 took 2.98 ms; whether its
    # verifies were under-priced or its 7-slot drafts cost the difference, those runs cannot say)
    cost_check_steps: list[int] = field(default_factory=list)
    cost_check_priced_ms: list[float] = field(default_factory=list)
    cost_check_wall_ms: list[float] = field(default_factory=list)
    # and their requests, summed: steps of one q at different batch sizes price differently, so a
    # slope over q read without the mean batch can be the batch's (H200 run 76's served steps)
    cost_check_requests: list[int] = field(default_factory=list)
    # "synthetic acceptance: timing only" when the speculative method is "synthetic" (acceptance
    # drawn from a configured curve, spec_decode/synthetic.py): the counters above are not the target's
    synthetic_acceptance: str | None = None

    def ensure_positions(self, k: int) -> None:
        for lst, zero in ((self.accepted_per_pos, 0), (self.verified_per_pos, 0), (self.predicted_accept_per_pos, 0.0)):
            while len(lst) < k:
                lst.append(zero)

    def record_drafts(self, k: int, spec_slots, verify_lens, accepted, surv, drafted: int | None = None) -> None:
        """Count one step's drafted requests: R drafts of `drafted` tokens (default k; fewer for a
        narrow draft, adaptive_draft_width "budget"), of which spec_slots[r] could be verified,
        verify_lens[r] were and accepted[r] (<= verify_lens[r]) were accepted; surv is [R, k]
        predicted survival. Array arithmetic, not a loop per request and slot: at 256
        requests and k = 7, 0.04 ms instead of 0.26 ms per step on a developer CPU."""
        verify_lens = np.asarray(verify_lens, dtype=np.int64)
        accepted_raw = np.asarray(accepted, dtype=np.int64)
        accepted = np.minimum(accepted_raw, verify_lens)  # per slot: accepted only where verified
        r = len(verify_lens)
        self.ensure_positions(k)
        width = k if drafted is None else drafted
        self.num_drafts += r
        self.num_draft_tokens += width * r
        verified_total = int(verify_lens.sum())
        self.num_verified_tokens += verified_total
        # of the slots drafted, those the request could not verify (a narrow draft's missing slots
        # were never proposed: they are no capped slots)
        self.num_capped_draft_slots += width * r - int(np.minimum(np.asarray(spec_slots, dtype=np.int64), width).sum())
        self.num_accepted_tokens += int(accepted_raw.sum())
        self.num_bonus_tokens += r
        counts = np.bincount(verify_lens)  # l_r -> requests (np.unique sorts: 5x the time at 256 rows)
        lengths = np.flatnonzero(counts)
        self.verify_len_hist.update(dict(zip(lengths.tolist(), counts[lengths].tolist())))
        pos = np.arange(k)[None, :]
        verified = verify_lens[:, None] > pos  # [R, k]: slot j was verified
        per_pos = zip(verified.sum(0).tolist(), (accepted[:, None] > pos).sum(0).tolist(),
                      np.where(verified, np.asarray(surv, dtype=np.float64)[:, :k], 0.0).sum(0).tolist())
        for j, (n_verified, n_accepted, predicted) in enumerate(per_pos):
            self.verified_per_pos[j] += n_verified
            self.accepted_per_pos[j] += n_accepted
            self.predicted_accept_per_pos[j] += predicted
        self.budget_hist[verified_total] += 1

    def record_step_cost(self, num_requests: int, base_tokens: int, budget: int, priced_ms: float,
                         wall_ms: float) -> None:
        """One drafting step the adaptive policy planned: R requests, base_tokens query tokens
        without drafts, B drafts verified; the tables priced it at priced_ms and it took wall_ms.
        Steps with prefill chunks (base_tokens > R) are left out: the tables do not price those."""
        if num_requests <= 0 or base_tokens != num_requests or budget is None:
            return
        q = max(1, -(-(base_tokens + int(budget)) // num_requests))
        for lst, zero in ((self.cost_check_steps, 0), (self.cost_check_priced_ms, 0.0), (self.cost_check_wall_ms, 0.0),
                          (self.cost_check_requests, 0)):
            while len(lst) < q:
                lst.append(zero)
        self.cost_check_steps[q - 1] += 1
        self.cost_check_requests[q - 1] += int(num_requests)
        self.cost_check_priced_ms[q - 1] += float(priced_ms)
        self.cost_check_wall_ms[q - 1] += float(wall_ms)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """1 + accepted / drafts: tokens a verifying request gains per step (bonus included)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        d = {k: (dict(v) if isinstance(v, Counter) else v) for k, v in self.__dict__.items()}
        d["acceptance_rate"] = self.acceptance_rate
        d["mean_accepted_length"] = self.mean_accepted_length
        return d
