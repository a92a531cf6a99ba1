"""What each kind of step really costs against what the cost tables price it at.

The cost tables (profiler.py) time replays of the propose and verify graphs on dummy inputs. A
real step pays more, and not in the same proportion for both kinds of step: a step that drafts is
synchronous (its accepted tokens are read back before the next step is planned), while a step that
does not draft runs under async scheduling where the engine has it (its host work hides behind the
GPU's). On the H200 at 64 requests of the 0.6B shape a drafted step took 7.2 ms of wall time and a
plain step of the no-spec engine 2.4 ms (BENCHMARKS.md, run 8), a gap the tables do not show, so a
policy that prices both from the tables drafts where a plain step makes more tokens per second.

`MeasuredStepCosts` keeps, per kind ("draft", "plain") and per batch-size bucket (powers of two of
the step's requests), an exponential average of wall time / priced time; the policy divides each
kind's expected token rate by its ratio. The walls are engine step-to-step intervals (everything
the loop does until it starts the next step), of past steps only, so no decision depends on a
current draft (lossless, policy.py). A kind never measured at a bucket borrows the nearest measured
bucket's ratio, else 1 (the tables alone).
"""
from __future__ import annotations

DRAFT, PLAIN = "draft", "plain"


class MeasuredStepCosts:
    def __init__(self, alpha: float = 0.2, clip: tuple[float, float] = (0.25, 50.0)):
        # alpha: weight of the newest step; clip: one outlier step (a garbage collection, a stall)
        # moves a ratio by at most alpha * clip
        self.alpha, self.clip = alpha, clip
        self.ratio: dict[tuple[str, int], float] = {}
        self.samples: dict[tuple[str, int], int] = {}

    @staticmethod
    def bucket(num_requests: int) -> int:
        """1 -> 1, 2-3 -> 2, 4-7 -> 3, ..., 256-511 -> 9."""
        return max(1, int(num_requests)).bit_length()

    def observe(self, kind: str, num_requests: int, wall_ms: float, priced_ms: float) -> None:
        if kind not in (DRAFT, PLAIN):
            raise ValueError(f"step kind must be {DRAFT!r} or {PLAIN!r}, got {kind!r}")
        if not priced_ms > 0 or not wall_ms >= 0:
            return
        lo, hi = self.clip
        r = min(hi, max(lo, wall_ms / priced_ms))
        key = (kind, self.bucket(num_requests))
        n = self.samples.get(key, 0)
        self.ratio[key] = r if n == 0 else self.alpha * r + (1.0 - self.alpha) * self.ratio[key]
        self.samples[key] = n + 1

    def scale(self, kind: str, num_requests: int) -> float:
        """wall / priced for a step of this kind and size: its bucket's, else the nearest measured
        bucket's (the smaller one on a tie), else 1."""
        b = self.bucket(num_requests)
        measured = [k for (kd, k) in self.ratio if kd == kind]
        if not measured:
            return 1.0
        nearest = min(measured, key=lambda k: (abs(k - b), k))
        return self.ratio[(kind, nearest)]

    def snapshot(self) -> dict[str, dict[int, float]]:
        """{kind: {bucket: ratio}}, for logs and benchmark records."""
        out: dict[str, dict[int, float]] = {DRAFT: {}, PLAIN: {}}
        for (kind, b), r in sorted(self.ratio.items()):
            out[kind][b] = round(r, 3)
        return out
