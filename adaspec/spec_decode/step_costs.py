"""What each kind of step really yields per unit of time, measured on the running engine.

The cost tables (profiler.py) time replays of the propose and verify graphs on dummy inputs. A
real step pays more, and not in the same proportion for both kinds of step: without the
speculative step's graphs a step that drafts is synchronous (its accepted tokens are read back
before the next step is planned), while a step that does not draft runs under async scheduling
where the engine has it (its host work hides behind the GPU's); with the graphs both kinds are
pipelined, and the tables still miss the host's share and the graphs' padding. On the H200 at 64
requests of the 0.6B shape a drafted step took 7.2 ms of wall time and a plain step of the no-spec
engine 2.4 ms (BENCHMARKS.md, run 8), a gap the tables do not show, so a policy that prices both
from the tables drafts where a plain step makes more tokens per second.

`MeasuredStepCosts` keeps, per kind ("draft", "plain") and per batch-size bucket (powers of two of
the step's requests), the tokens a step of that kind produced per request per millisecond of wall
time: the objective itself, realized, so neither the tables' prices nor the confidences'
calibration enter the draft-or-not choice once both kinds are measured at a bucket. It is a ratio
of exponentially decayed sums (tokens over request-milliseconds), each step weighted by its
requests up to `alpha`. A step over few requests emits a noisy count (at one request and T = 1, 1
to 8 tokens), and the average of the last few steps' own ratios that this was until H100 run 62
dipped below the plain rate after a few short steps, though drafting made 1.8x the plain rate
there; each dip ran plain steps until the next probe, 32-54% of the decode steps in all
(BENCHMARKS.md, run 62). (Run 10 and 11 scaled the tables' prices by measured wall / priced ratios
instead; at 16 requests that chose plain steps where drafting made 1.2x the tokens.) The walls are engine
step-to-step intervals (without the graphs, everything the loop does until it starts the next
step, policy.step_started; pipelined, from the previous step's results to this one's,
LLMEngine._time_spec_step) and the tokens
those the step emitted, of past steps only: no decision depends on a current draft (lossless,
policy.py).
"""
from __future__ import annotations

DRAFT, PLAIN = "draft", "plain"


class MeasuredStepCosts:
    def __init__(self, alpha: float = 0.3, min_samples: int = 2, max_age: int = 128, request_window: float = 32.0):
        # alpha: the most weight a new step gets (acceptance drifts with the text, the batch with
        # arrivals); a step over R requests gets min(alpha, R / request_window): at one request the
        # rate spans ~request_window steps, from ~10 requests on the newest step weighs alpha;
        # min_samples: a bucket's rate is used once that many steps of the kind were measured there;
        # max_age: a rate not updated during that many measured steps (of any kind and bucket) is
        # forgotten, and the next step of its kind there starts it afresh. In H200 run 12 the rate of
        # drafting at 16-31 requests had been measured in the last steps of a point at 256 requests
        # (requests near max_tokens, few draft slots, 0.46 tokens per request per ms); the next point
        # at 16 requests, where drafting made 0.76, ran mostly plain steps while the stale average
        # caught up through probes
        if not 0 < alpha <= 1 or not request_window > 0:
            raise ValueError(f"alpha must be in (0, 1] and request_window > 0, got {alpha}, {request_window}")
        self.alpha, self.min_samples, self.max_age, self.request_window = alpha, min_samples, max_age, request_window
        # decayed sums per (kind, bucket): tokens, and requests x ms; the rate is their ratio
        self.tokens: dict[tuple[str, int], float] = {}
        self.request_ms: dict[tuple[str, int], float] = {}
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
        key = (kind, self.bucket(num_requests))
        n = self.count(kind, num_requests)  # 0 when stale: start afresh
        keep = 0.0 if n == 0 else 1.0 - min(self.alpha, num_requests / self.request_window)
        # decayed sums (not an average of ratios): the first steps weigh alike until the decay
        # takes over, and a step counts in proportion to its time
        self.tokens[key] = keep * self.tokens.get(key, 0.0) + tokens
        self.request_ms[key] = keep * self.request_ms.get(key, 0.0) + num_requests * wall_ms
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
        key = (kind, self.bucket(num_requests))
        return self.tokens[key] / self.request_ms[key]

    def snapshot(self) -> dict[str, dict[int, float]]:
        """{kind: {bucket: tokens per request per ms}}, for logs and benchmark records."""
        out: dict[str, dict[int, float]] = {DRAFT: {}, PLAIN: {}}
        for (kind, b) in sorted(self.tokens):
            out[kind][b] = round(self.tokens[(kind, b)] / self.request_ms[(kind, b)], 4)
        return out
