"""A virtual clock shared by the fake server (which moves it) and the bench client (which reads it).

The server does not sleep: it advances the clock by a chunk's scripted delay, writes the chunk,
then waits until the client has read the clock once more. The client reads it exactly when an
SSE event completes, so every chunk is stamped with its scripted time however loaded the machine
is. Valid for one stream at a time (max_concurrency=1): a read by another stream would release
the wait early.
"""
from __future__ import annotations

import asyncio
import threading
import time


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._reads = 0
        self._lock = threading.Lock()
        self.stalled = False  # a wait for a read timed out (see wait_read_after)

    def __call__(self) -> float:
        with self._lock:
            self._reads += 1
            return self._now

    @property
    def reads(self) -> int:
        with self._lock:
            return self._reads

    def advance(self, dt: float) -> None:
        with self._lock:
            self._now += dt

    async def wait_read_after(self, seen: int, safety_s: float = 5.0) -> None:
        """Until the clock was read more than `seen` times. If it is not (a client that does not
        stamp events with this clock, or one that left), the clock is marked `stalled` and never
        waits again: the test then fails on its values and on `stalled`, quickly, never hangs.
        The real-time bound decides no measured value."""
        give_up = time.monotonic() + safety_s
        while self.reads <= seen and not self.stalled:
            if time.monotonic() > give_up:
                self.stalled = True
                return
            await asyncio.sleep(0.0005)
