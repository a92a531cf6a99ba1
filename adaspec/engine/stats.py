"""Engine counters: monotonic totals, read between steps (the server turns them into Prometheus)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens run through the target (recomputes included)
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    # async scheduling: rows computed for requests that had stopped in the step before (wasted)
    num_discarded_rows: int = 0
    # speculative decoding (vLLM's spec_decode counters)
    num_drafts: int = 0  # requests that got a draft proposal in a step
    num_draft_tokens: int = 0  # proposed draft tokens (k per draft)
    num_verified_tokens: int = 0  # drafts the policy sent to verification
    num_accepted_tokens: int = 0
    num_bonus_tokens: int = 0  # tokens sampled from the target (one per verifying request per step)
    num_sampled_without_draft: int = 0  # tokens sampled in steps where the request had no draft
    num_steps_draft_skipped: int = 0  # adaptive: steps where drafting was predicted not to pay
    num_capped_draft_slots: int = 0  # proposed slots that could never be verified (near max_tokens)
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
    # "synthetic acceptance: timing only" when the speculative method is "synthetic" (acceptance
    # drawn from a configured curve, spec_decode/synthetic.py): the counters above are not the target's
    synthetic_acceptance: str | None = None

    def ensure_positions(self, k: int) -> None:
        for lst, zero in ((self.accepted_per_pos, 0), (self.verified_per_pos, 0), (self.predicted_accept_per_pos, 0.0)):
            while len(lst) < k:
                lst.append(zero)

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
