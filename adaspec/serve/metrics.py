"""Prometheus metrics (names close to vLLM's, prefix ``adaspec:``) on a private registry.

The engine's counters (``engine.stats``) are cumulative and may only be read by the engine
thread, so that thread calls :meth:`ServerMetrics.after_step` and this module adds the delta
since the previous read. prometheus-client's metric objects are thread-safe, so the HTTP side
can render them at scrape time while the engine thread updates them.

With several API server processes (``--api-server-count``) a scrape lands on any one of them, so
the metrics live in prometheus-client's multiprocess files (as vLLM does) and every process
renders the sum: each counts its own requests, only the first adds the engine's counters (every
process sees the same engine totals), and the gauges show the most recent value.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_BUDGET_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)

# engine.stats field -> counter name (suffix _total is added by prometheus-client)
_STAT_COUNTERS = {
    "num_prompt_tokens": ("prompt_tokens", "Prefilled prompt tokens."),
    "num_generated_tokens": ("generation_tokens", "Generated (emitted) tokens."),
    "num_preemptions": ("num_preemptions", "Requests preempted for lack of KV blocks."),
    "num_steps": ("engine_steps", "Engine steps run."),
    "time_in_steps": ("engine_step_seconds", "Wall seconds the engine spent inside its steps (host work and "
                      "waiting for the GPU); the rest of its loop took requests, sent news or waited for work."),
    "num_drafts": ("spec_decode_num_drafts", "Speculative drafts proposed (one per request per step)."),
    "num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target."),
    "num_verified_tokens": ("spec_decode_num_verified_tokens", "Tokens scored by the target in verification."),
    "num_steps_draft_skipped": ("spec_decode_draft_skipped_steps",
                                "Steps where the adaptive policy predicted drafting would not pay."),
    "num_mixed_steps_fused": ("spec_decode_mixed_steps_fused",
                              "Steps with prompt chunks run without drafts as one forward "
                              "(adaptive_verification_mixed_steps \"fused\")."),
}
# per draft position (label "position", 0 = first): the calibration view, predicted vs realized
_POS_COUNTERS = {
    "accepted_per_pos": ("spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position."),
    "verified_per_pos": ("spec_decode_num_verified_tokens_per_pos", "Verified draft tokens by draft position."),
    "predicted_accept_per_pos": ("spec_decode_predicted_accepted_tokens_per_pos",
                                 "Sum of the predicted survival of verified drafts by position (compare with accepted)."),
}
# per query tokens per request of a decode-only drafting step (label "query_len", 1 = no drafts
# verified): the adaptive policy's cost tables against the steps they priced (engine/stats.py)
_QLEN_COUNTERS = {
    "cost_check_steps": ("spec_decode_cost_check_steps", "Decode-only drafting steps the adaptive policy planned."),
    "cost_check_priced_ms": ("spec_decode_cost_check_priced_ms",
                             "What the adaptive policy's cost tables priced those steps at (ms, summed)."),
    "cost_check_wall_ms": ("spec_decode_cost_check_wall_ms", "What those steps took (ms of wall time, summed)."),
    "cost_check_requests": ("spec_decode_cost_check_requests", "The requests those steps ran (summed)."),
}


# every engine.stats field update_engine reads: the engine process ships exactly these to the HTTP
# side (serve/engine_process.py EngineSnapshot), so a counter added above reaches /metrics there too
ENGINE_STATS_READ = (*_STAT_COUNTERS, *_POS_COUNTERS, *_QLEN_COUNTERS, "budget_hist", "synthetic_acceptance")


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# set with it by use_multiprocess_dir: a PROMETHEUS_MULTIPROC_DIR of the user's own (files of
# earlier processes in it) must not make one server's render sum them
OURS_ENV = "ADASPEC_METRICS_DIR"


def use_multiprocess_dir(path: str | None) -> Callable[[], None]:
    """From now on, in this process and the processes it starts (they inherit the environment),
    metric values live in files under ``path`` and render() sums them over the processes (None:
    nothing changes). prometheus-client picks its value class when it is imported, which happened
    already here. -> a function that puts both back as they were."""
    if path is None:
        return lambda: None
    before_env = {k: os.environ.get(k) for k in (MULTIPROC_ENV, OURS_ENV)}
    before_class = values.ValueClass
    os.environ[MULTIPROC_ENV] = os.environ[OURS_ENV] = str(path)
    values.ValueClass = values.MultiProcessValue()

    def restore() -> None:
        values.ValueClass = before_class
        for k, v in before_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return restore


class ServerMetrics:
    def __init__(self, model_name: str, engine_counters: bool = True):
        """engine_counters: add the engine's counters (False in all API servers but the first)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.engine_counters = engine_counters
        self.multiprocess_dir = os.environ.get(OURS_ENV) or None
        self._children: dict[tuple, object] = {}  # (metric, label items) -> its labelled child
        r, L = self.registry, ["model_name"]

        def counter(name, doc, labels=()):
            return Counter(f"adaspec:{name}", doc, L + list(labels), registry=r)

        self.request_success = counter("request_success", "Finished requests.", ["finished_reason"])
        self.request_errors = counter("request_errors", "Requests refused with an HTTP error.", ["status"])
        def gauge(name, doc, labels=()):  # "mostrecent": with several processes, the latest value set
            return Gauge(f"adaspec:{name}", doc, L + list(labels), registry=r, multiprocess_mode="mostrecent")

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.ttft = Histogram("adaspec:time_to_first_token_seconds", "Arrival to first token.", L,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("adaspec:inter_token_latency_seconds",
                             "Time between consecutive output chunks of a request (one chunk per step).",
                             L, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("adaspec:e2e_request_latency_seconds", "Arrival to finish.", L,
                             buckets=_E2E_BUCKETS, registry=r)
        self.stat_counters = {f: counter(n, d) for f, (n, d) in _STAT_COUNTERS.items()}
        # field -> (counter, its label, the label of list index 0)
        self.pos_counters = {f: (counter(n, d, ["position"]), "position", 0) for f, (n, d) in _POS_COUNTERS.items()}
        self.pos_counters.update({f: (counter(n, d, ["query_len"]), "query_len", 1)
                                  for f, (n, d) in _QLEN_COUNTERS.items()})
        self.budget_steps = counter("spec_decode_budget_steps",
                                    "Engine steps by the speculation budget B used.", ["budget"])
        self.budget = Histogram("adaspec:spec_decode_budget", "Speculation budget B per engine step.", L,
                                buckets=_BUDGET_BUCKETS, registry=r)
        # set (to 1, label note="synthetic acceptance: timing only") only when the speculative method
        # is "synthetic": the spec counters then follow a configured curve, not the target
        self.synthetic = gauge("spec_decode_synthetic_acceptance",
                               "1: acceptance is drawn from a configured curve (method synthetic), timing only.",
                               ["note"])
        # Create every unlabelled series now, so a scrape before the first request sees zeros
        # (dashboards and rate() need the series to exist), as vLLM does.
        for m in (self.running, self.waiting, self.kv_usage, self.ttft, self.itl, self.e2e, self.budget,
                  *self.stat_counters.values()):
            m.labels(model_name=model_name)
        for reason in ("stop", "length", "abort"):
            self._c(self.request_success, finished_reason=reason)
        self._last: dict[str, float] = {}
        self._last_pos: dict[str, list[float]] = {}
        self._last_budget: dict[str, float] = {}
        self._last_chunk: dict[str, float] = {}  # request id -> time of its previous chunk

    def _c(self, c: Counter, **labels):
        # prometheus-client's labels() validates and hashes its arguments on every call (about a
        # third of the engine thread's time per streamed chunk at 256 requests): look each
        # labelled child up once
        key = (id(c), *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = c.labels(model_name=self.model_name, **labels)
        return child

    def _g(self, g):
        return self._c(g)

    # ---- called from the engine thread only ----
    def update_engine(self, engine) -> None:
        """Gauges and counter deltas from the engine (engine thread only)."""
        self._g(self.running).set(engine.num_running())
        self._g(self.waiting).set(engine.num_waiting())
        total = engine.kv_blocks_total()
        self._g(self.kv_usage).set(1.0 - engine.kv_blocks_free() / total if total else 0.0)
        stats = getattr(engine, "stats", None)
        if stats is None:
            return
        if getattr(stats, "synthetic_acceptance", None):
            self.synthetic.labels(model_name=self.model_name, note=stats.synthetic_acceptance).set(1)
        if not self.engine_counters:
            return
        for field, c in self.stat_counters.items():
            v = getattr(stats, field, None)
            if v is None:
                continue
            d = v - self._last.get(field, 0)
            if d > 0:
                self._c(c).inc(d)
            self._last[field] = v
        for field, (c, label, first) in self.pos_counters.items():
            pos = list(getattr(stats, field, None) or [])
            last = self._last_pos.get(field, [])
            for i, v in enumerate(pos):
                d = v - (last[i] if i < len(last) else 0)
                if d > 0:
                    self._c(c, **{label: str(i + first)}).inc(d)
            self._last_pos[field] = pos
        hist = dict(getattr(stats, "budget_hist", None) or {})
        for b, v in hist.items():
            d = v - self._last_budget.get(str(b), 0)
            if d > 0:
                self._c(self.budget_steps, budget=str(b)).inc(d)
                for _ in range(min(int(d), 10_000)):  # d is the steps since the last read: ~1
                    self._g(self.budget).observe(float(b))
            self._last_budget[str(b)] = v

    def on_chunk(self, request_id: str, first_chunk: bool, arrival: float, first_token_time: float | None) -> None:
        now = time.monotonic()
        if first_chunk:
            self._c(self.ttft).observe(max(0.0, (first_token_time or now) - arrival))
        else:
            prev = self._last_chunk.get(request_id)
            if prev is not None:
                self._c(self.itl).observe(max(0.0, now - prev))
        self._last_chunk[request_id] = now

    def on_finish(self, request_id: str, reason: str, arrival: float) -> None:
        self._last_chunk.pop(request_id, None)
        self._c(self.request_success, finished_reason=reason).inc()
        self._c(self.e2e).observe(max(0.0, time.monotonic() - arrival))

    # ---- any thread ----
    def on_error(self, status: int) -> None:
        self._c(self.request_errors, status=str(status)).inc()

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        everyone = CollectorRegistry()
        multiprocess.MultiProcessCollector(everyone, path=self.multiprocess_dir)
        return generate_latest(everyone)
