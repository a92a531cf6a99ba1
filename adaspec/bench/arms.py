"""Sweep arms: `none`, `fixed:K`, `adaptive:K`, `adaptive-measured:K` (adaptive verification whose
draft-or-not choice uses the step costs measured on the running engine, spec_decode/step_costs.py),
`adaptive-narrow:K` (adaptive verification drafting only the slots its budget can use:
"adaptive_draft_width": "budget"), `adaptive-overhead:K` (adaptive verification pricing every
candidate step with the host's measured per-step overhead added, written out:
"adaptive_verification_step_overhead_ms": "measured"), `adaptive-tables:K` (adaptive verification
priced by the cost tables alone, as vLLM prices it, written out: "adaptive_verification_step_overhead_ms":
0, the default), `adaptive-tracked:K` (adaptive verification
whose budget scales the confidences by what the target accepted lately, per position:
"adaptive_verification_online_calibration": true), `adaptive-population:K` (adaptive verification
counting a request no step drafted for yet at the running average of the observed confidences
instead of 1.0: "adaptive_verification_unobserved_confidence": "population"), `adaptive-fused:K`
(adaptive verification judging a step with prompt chunks at the margin and running one it does not
draft as one forward with the chunks: "adaptive_verification_mixed_steps": "fused"),
`adaptive-fused-overhead:K` (the fused mode priced with the measured per-step overhead: an overhead
lowers the decode-only rate its margin values the extra time at, benchmarks/mixed_step_check.py),
`adaptive-fused-measured:K` (the fused mode with measured step costs: its margin values the extra
time at the rate the engine's decode-only steps measured, and those steps' draft-or-not choice is
adaptive-measured's, policy.mixed_step_terms), and the --speculative-config each one gets."""
from __future__ import annotations

import re
from dataclasses import dataclass

from adaspec.errors import AdaspecError

ADAPTIVE_KINDS = ("adaptive", "adaptive-measured", "adaptive-narrow", "adaptive-overhead", "adaptive-tables",
                  "adaptive-tracked", "adaptive-population", "adaptive-fused", "adaptive-fused-overhead",
                  "adaptive-fused-measured")
SPECULATIVE_KINDS = ("fixed",) + ADAPTIVE_KINDS
_ARM = re.compile(r"^(none|(" + "|".join(SPECULATIVE_KINDS) + r"):(\d+))$")


class ArmError(AdaspecError):
    """An arm name the sweep does not know."""


@dataclass(frozen=True)
class Arm:
    name: str  # as the user wrote it: "none", "fixed:7", "adaptive:7"
    kind: str  # none | fixed | one of ADAPTIVE_KINDS
    k: int = 0

    @property
    def slug(self) -> str:
        """File-name safe form ("fixed-7")."""
        return slug(self.name)

    def speculative_config(self, drafter: str | None, temperature: float, extra: dict | None = None) -> dict | None:
        if self.kind == "none":
            return None
        cfg: dict = {"method": "dspark", "num_speculative_tokens": self.k}
        if drafter:
            cfg["model"] = drafter
        if self.kind in ADAPTIVE_KINDS:
            cfg["enable_adaptive_verification"] = True
        if self.kind in ("adaptive-measured", "adaptive-fused-measured"):
            cfg["adaptive_verification_step_costs"] = "measured"
        if self.kind == "adaptive-narrow":
            cfg["adaptive_draft_width"] = "budget"
        if self.kind in ("adaptive-overhead", "adaptive-fused-overhead"):
            cfg["adaptive_verification_step_overhead_ms"] = "measured"
        if self.kind == "adaptive-tables":
            cfg["adaptive_verification_step_overhead_ms"] = 0.0
        if self.kind == "adaptive-tracked":
            cfg["adaptive_verification_online_calibration"] = True
        if self.kind == "adaptive-population":
            cfg["adaptive_verification_unobserved_confidence"] = "population"
        if self.kind in ("adaptive-fused", "adaptive-fused-overhead", "adaptive-fused-measured"):
            cfg["adaptive_verification_mixed_steps"] = "fused"
        # Sampled targets need probabilistic drafts for lossless rejection sampling.
        cfg["draft_sample_method"] = "probabilistic" if temperature > 0 else "greedy"
        cfg.update(extra or {})  # same extra keys for every speculative arm (e.g. profiling settings)
        return cfg


def parse_arm(text: str) -> Arm:
    t = text.strip()
    m = _ARM.match(t)
    if not m:
        raise ArmError(f"unknown arm {text!r}; use none, fixed:K, adaptive:K, adaptive-measured:K, adaptive-narrow:K, "
                       "adaptive-overhead:K, adaptive-tables:K, adaptive-tracked:K, adaptive-population:K, "
                       "adaptive-fused:K, adaptive-fused-overhead:K or adaptive-fused-measured:K (K >= 1)")
    if t == "none":
        return Arm(t, "none")
    k = int(m.group(3))
    if k < 1:
        raise ArmError(f"arm {text!r}: K must be at least 1")
    return Arm(t, m.group(2), k)


def parse_arms(text: str) -> list[Arm]:
    arms = [parse_arm(a) for a in text.split(",") if a.strip()]
    if not arms:
        raise ArmError("--arms is empty")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ArmError(f"--arms lists an arm twice: {text}")
    return arms


def external_arm(name: str) -> Arm:
    """An arm served by a server the sweep did not start: any label; its config is what it parses to."""
    try:
        return parse_arm(name)
    except ArmError:
        return Arm(name, "external")


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name)


def refuse_slug_collisions(names) -> None:
    """Two arm names with one file-name form would write the same point and log files (one arm's
    points taken for the other's): refused, naming both."""
    seen: dict[str, str] = {}
    for name in names:
        s = slug(name)
        if seen.get(s, name) != name:
            raise ArmError(f"arms {seen[s]!r} and {name!r} would share the file name {s!r} (points/{s}_c*_r*.json, "
                           f"logs/{s}.log): rename one of them")
        seen.setdefault(s, name)
