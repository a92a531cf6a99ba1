"""What each kind of step really yields per unit of time, measured on the running engine.

The cost tables (profiler.py) time replays of the propose and verify graphs on dummy inputs. A
real step pays more, and not in the same proportion for both kinds of step: a step that drafts is
synchronous (its accepted tokens are read back before the next step is planned), while a step that
does not draft runs under async scheduling where the engine has it (its host work hides behind the
GPU's). On the H200 at 64 requests of the 0.6B shape a drafted step took 7.2 ms of wall time and a
plain step of the no-spec engine 2.4 ms (BENCHMARKS.md, run 8), a gap the tables do not show, so a
policy that prices both from the tables drafts where a plain step makes more tokens per second.

`MeasuredStepCosts` keeps, per kind ("draft", "plain") and per batch-size bucket (powers of two of
the step's requests), an exponential average of the tokens a step of that kind produced per
request per millisecond of wall time: the objective itself, realized, so neither the tables' prices
nor the confidences' calibration enter the draft-or-not choice once both kinds are measured at a
bucket. (Run 10 and 11 scaled the tables' prices by measured wall / priced ratios instead; at 16
requests that chose plain steps where drafting made 1.2x the tokens.) The walls are engine
step-to-step intervals (everything the loop does until it starts the next step) and the tokens
those the step emitted, of past steps only: no decision depends on a current draft (lossless,
policy.py).
"""
from __future__ import annotations

DRAFT, PLAIN = "draft", "plain"


class MeasuredStepCosts:
    def __init__(self, alpha: float = 0.3, min_samples: int = 2, max_age: int = 128):
        # alpha: weight of the newest step (acceptance drifts with the text, the batch with arrivals);
        # min_samples: a bucket's rate is used once that many steps of the kind were measured there;
        # max_age: a rate not updated during that many measured steps (of any kind and bucket) is
        # forgotten, and the next step of its kind there starts it afresh. In H200 run 12 the rate of
        # drafting at 16-31 requests had been measured in the last steps of a point at 256 requests
        # (requests near max_tokens, few draft slots, 0.46 tokens per request per ms); the next point
        # at 16 requests, where drafting made 0.76, ran mostly plain steps while the stale average
        # caught up through probes
        self.alpha, self.min_samples, self.max_age = alpha, min_samples, max_age
        self.rates: dict[tuple[str, int], float] = {}
        self.samples: dict[tuple[str, int], int] = {}
        self.num_observed = 0  # steps measured so far (the clock of max_age)
        self._updated: dict[tuple[str, int], int] = {}  # key -> num_observed at its last update

    @staticmethod
    def bucket(num_requests: int) -> int:
        """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..., 129-256 -> 8: each bucket ends at a power of two,
        so a closed loop of C = 2^b requests whose batch dips by a few while requests finish and
        join stays in one bucket (with buckets starting at powers of two, H200 run 12's points at
        16 and 64 requests split their steps over two buckets and explored both)."""
        return max(0, int(num_requests) - 1).bit_length()

    def observe(self, kind: str, num_requests: int, wall_ms: float, tokens: int) -> None:
        """A step of `kind` over num_requests took wall_ms and emitted `tokens`."""
        if kind not in (DRAFT, PLAIN):
            raise ValueError(f"step kind must be {DRAFT!r} or {PLAIN!r}, got {kind!r}")
        if not wall_ms > 0 or num_requests < 1 or tokens < 0:
            return
        r = tokens / (num_requests * wall_ms)
        key = (kind, self.bucket(num_requests))
        n = self.count(kind, num_requests)  # 0 when stale: start afresh
        self.rates[key] = r if n == 0 else self.alpha * r + (1.0 - self.alpha) * self.rates[key]
        self.samples[key] = n + 1
        self.num_observed += 1
        self._updated[key] = self.num_observed

    def count(self, kind: str, num_requests: int) -> int:
        """Steps of this kind measured at this batch size's bucket since its rate was last
        (re)started; 0 once the rate is stale (max_age)."""
        key = (kind, self.bucket(num_requests))
        n = self.samples.get(key, 0)
        if n and self.num_observed - self._updated[key] > self.max_age:
            return 0
        return n

    def rate(self, kind: str, num_requests: int) -> float | None:
        """Tokens per request per ms of this kind at this batch size's bucket, or None (not yet
        measured min_samples times there, or stale)."""
        if self.count(kind, num_requests) < self.min_samples:
            return None
        return self.rates[(kind, self.bucket(num_requests))]

    def snapshot(self) -> dict[str, dict[int, float]]:
        """{kind: {bucket: tokens per request per ms}}, for logs and benchmark records."""
        out: dict[str, dict[int, float]] = {DRAFT: {}, PLAIN: {}}
        for (kind, b), r in sorted(self.rates.items()):
            out[kind][b] = round(r, 4)
        return out
