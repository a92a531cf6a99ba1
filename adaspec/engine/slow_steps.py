"""A log line for every engine step slower than a threshold, saying what the step ran and what
compiled or collected garbage while it ran: the tool for one-time stalls that a mean step time
hides (H200 runs 13-24: an arm's first point after its server started lost ~0.1-0.7 s once,
seen only as a high p90 TTFT).

Off unless ``ADASPEC_LOG_SLOW_STEPS_MS`` is set (e.g. 50): then the engine logs, at WARNING on
the ``adaspec.engine`` logger, each step() that took longer, with

- its shape: requests scheduled, prefill rows and their tokens, decode rows, draft slots;
- Triton kernels compiled or loaded in this process during the step (names), through Triton's
  post-compile hook (``triton.knobs.runtime.jit_post_compile_hook``) where this Triton has it;
- torch.compile (Dynamo) graphs compiled during the step (``torch._dynamo.utils.counters``; in
  H200 run 25 the frame counter this read first stayed empty, so a 701 ms step showed none);
- Python garbage collections during the step and the time they took (``gc.callbacks``).

Only host-side events are attributed; a stall on the GPU shows as a slow step with none of them.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from collections import Counter
from typing import Callable

from adaspec.errors import ConfigError

ENV = "ADASPEC_LOG_SLOW_STEPS_MS"


def threshold_from_env(environ=os.environ) -> float | None:
    """The threshold in ms from ADASPEC_LOG_SLOW_STEPS_MS, None when unset or empty."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{ENV} must be a number of milliseconds, got {raw!r}") from None
    if not value >= 0:
        raise ConfigError(f"{ENV} must be >= 0 ms, got {raw!r}")
    return value


def dynamo_graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (0 when Dynamo was never loaded)."""
    import sys

    if "torch._dynamo" not in sys.modules:  # importing it only to read a counter costs seconds
        return 0
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - a diagnostic must never break the engine
        return 0
    # graphs Dynamo produced (a recompile adds one); torch 2.13 leaves counters["frames"] empty
    return int(counters["stats"].get("unique_graphs", 0))


class SlowStepLog:
    """Watches steps: begin() before one, end(shape) after it; logs the slow ones.

    ``clock`` returns seconds (tests pass a fake one). Compile and GC events are counted by hooks
    installed once per instance (install()); uninstall() removes them."""

    def __init__(self, threshold_ms: float, logger: logging.Logger, clock: Callable[[], float] = time.perf_counter):
        self.threshold_ms = threshold_ms
        self.log = logger
        self.clock = clock
        self.num_logged = 0
        self._t0 = 0.0
        self._kernels: Counter = Counter()  # Triton kernels compiled since begin()
        self._variants: list[str] = []  # and Triton's description of each (its specialization)
        self._gc_runs = 0
        self._gc_s = 0.0
        self._gc_started: float | None = None
        self._graphs0 = 0
        self._triton_previous = None
        self._triton_installed = False

    # -- hooks ---------------------------------------------------------------------------------
    def install(self) -> "SlowStepLog":
        gc.callbacks.append(self._on_gc)
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001 - no Triton, or one without knobs: no kernel names
            return self
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            self._triton_previous = runtime.jit_post_compile_hook
            runtime.jit_post_compile_hook = self._on_triton_compile
            self._triton_installed = True
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._triton_installed:
            from triton import knobs

            knobs.runtime.jit_post_compile_hook = self._triton_previous
            self._triton_installed = False

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_runs += 1
            self._gc_s += time.perf_counter() - self._gc_started
            self._gc_started = None

    def _on_triton_compile(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or "kernel"
        self._kernels[name] += 1
        if kwargs.get("repr"):
            self._variants.append(str(kwargs["repr"]))
        if self._triton_previous is not None:
            return self._triton_previous(*args, **kwargs)
        return None

    def note_triton_compile(self, name: str) -> None:
        """Count one compiled Triton kernel (what the hook does; for tests without Triton)."""
        self._kernels[name] += 1

    # -- steps ---------------------------------------------------------------------------------
    def begin(self) -> None:
        self._kernels.clear()
        self._variants.clear()
        self._gc_runs, self._gc_s = 0, 0.0
        self._graphs0 = dynamo_graphs_compiled()
        self._t0 = self.clock()

    def end(self, shape: str) -> str | None:
        """Log the step begun last if it was slow: -> the line logged, or None."""
        ms = 1e3 * (self.clock() - self._t0)
        if ms <= self.threshold_ms:
            return None
        graphs = dynamo_graphs_compiled() - self._graphs0
        parts = [f"slow engine step: {ms:.1f} ms (threshold {self.threshold_ms:g} ms); {shape}"]
        if self._kernels:
            names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(self._kernels.items()))
            parts.append(f"Triton kernels compiled: {names}")
            if self._variants:  # which specialization was new: e.g. an int argument's divisibility by 16
                parts.append("variants: " + " | ".join(self._variants))
        if graphs:
            parts.append(f"torch.compile graphs compiled: {graphs}")
        if self._gc_runs:
            parts.append(f"garbage collections: {self._gc_runs} ({1e3 * self._gc_s:.1f} ms)")
        if len(parts) == 1:
            parts.append("no compile or garbage collection on the host during it")
        line = "; ".join(parts)
        self.log.warning(line)
        self.num_logged += 1
        return line


def step_shape(scheduled) -> str:
    """What a step scheduled, in words: requests, prefill rows and tokens, decodes, draft slots."""
    prefill = [s for s in scheduled if s.num_tokens > 1 or not s.samples]
    decode = len(scheduled) - len(prefill)
    slots = sum(getattr(s, "spec_slots", 0) for s in scheduled)
    text = (f"{len(scheduled)} requests: {len(prefill)} prefill rows of {sum(s.num_tokens for s in prefill)} "
            f"tokens, {decode} decodes")
    return text + (f", {slots} draft slots" if slots else "")
