"""A wall-clock budget for a training loop, kept by refitting its step count as it runs.

`train drafter --max-minutes M` trains as many steps as M minutes fit, with the cosine schedule
following the fitted total. One estimate from a few early steps is not enough: in H200 run 33
the step times alternated between ~35 and ~48 ms over blocks of 100 steps, the 30-step probe saw
the fast ones, and the 150 s box ran 170-181 s. So the fit is made again every `every` steps
from the mean step time since the probe began, until the box closes; late refits move the total
by a few steps, and the schedule's learning rate with it by a hair.

Pure arithmetic over a clock passed in (tests give a fake one); `sync` is called right before
the clock is read at a fit, so that the GPU's queued work is counted (the training loop does
not otherwise wait for the GPU). The refits fall on multiples of `every`, where the loop has
just read its logged loss back (a sync of its own), so they add no wait of their own.
"""
from __future__ import annotations

import time
from typing import Callable


def _now() -> float:  # looked up at each call, so a test can put a fake clock in its place
    return time.monotonic()


class StepTimeBox:
    """Call `fit(step)` at the top of every step; it returns the step total to train with (the
    same one except at a fit). The total never exceeds `max_steps` (the run's --steps) and is at
    least step + 1 (the current step runs)."""

    def __init__(self, seconds: float, start_step: int, max_steps: int, clock: Callable[[], float] | None = None,
                 sync: Callable[[], None] = lambda: None, warmup: int = 10, probe: int = 30, every: int = 100):
        if seconds <= 0:
            raise ValueError(f"time box of {seconds} s: give a positive budget")
        self.seconds, self.max_steps, self.total = float(seconds), max_steps, max_steps
        self.clock, self.sync, self.every = clock or _now, sync, every
        self.t0 = self.clock()
        # the first steps pay CUDA warmup and compilation: timing starts after them
        self.probe_start, self.first_fit = start_step + warmup, start_step + warmup + probe
        self.probe_t: float | None = None
        self.fits: list[tuple[int, float, int]] = []  # (step, seconds per step, total) at each fit

    def fit(self, step: int) -> int:
        if step == self.probe_start:
            self.sync()
            self.probe_t = self.clock()
        elif self.probe_t is not None and (step == self.first_fit or step > self.first_fit and step % self.every == 0):
            self.sync()
            now = self.clock()
            per_step = (now - self.probe_t) / (step - self.probe_start)
            left = self.seconds - (now - self.t0)
            fitted = step + int(left / per_step) if per_step > 0 else self.max_steps
            self.total = max(step + 1, min(self.max_steps, fitted))
            self.fits.append((step, per_step, self.total))
        return self.total
