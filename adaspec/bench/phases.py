"""A load that moves: a run whose concurrency cap changes phase by phase (`--load-phases`).

`--load-phases 1x20,64x200,1x20` sends 20 requests at most 1 in flight, then 200 at most 64 in
flight, then 20 at most 1 in flight, as one run against one server. Requests go out in order; a
request of phase p is sent only while fewer than C_p requests are in flight (its own phase's
and any the previous phase still has running), so the in-flight count never exceeds the cap of
the phase of the request being sent. Going up (1 -> 64) the next phase starts at once; going down
(64 -> 1) it starts when the previous phase has drained below its cap.

Per-phase metrics are the run's metrics (metrics.compute_metrics) over the requests of that
phase, with the phase's span (its first send to its last completion) as the duration: phases
overlap where one drains while the next starts, so phase throughputs need not add up to the
whole run's.
"""
from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Awaitable, Callable

from adaspec.errors import AdaspecError


class PhaseError(AdaspecError):
    """A --load-phases value that cannot be read."""


@dataclass(frozen=True)
class Phase:
    max_concurrency: int
    num_requests: int

    def label(self) -> str:
        return f"{self.max_concurrency}x{self.num_requests}"


_PHASE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_phases(text: str) -> list[Phase]:
    """'1x20,64x200,1x20' -> phases (concurrency x number of requests)."""
    phases = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        m = _PHASE.match(part)
        if not m:
            raise PhaseError(f"--load-phases takes CONCURRENCYxREQUESTS items separated by commas "
                             f"(e.g. 1x20,64x200,1x20), got {part.strip()!r}")
        c, n = int(m.group(1)), int(m.group(2))
        if c < 1 or n < 1:
            raise PhaseError(f"--load-phases item {part.strip()!r}: concurrency and requests must be at least 1")
        phases.append(Phase(c, n))
    if not phases:
        raise PhaseError("--load-phases is empty; give e.g. 1x20,64x200,1x20")
    return phases


def format_phases(phases: list[Phase]) -> str:
    return ",".join(p.label() for p in phases)


def phase_of_requests(phases: list[Phase]) -> list[int]:
    """The phase index of every request, in send order."""
    return [i for i, p in enumerate(phases) for _ in range(p.num_requests)]


async def run_phased(send: Callable[[int], Awaitable], caps: list[int]) -> list:
    """Call send(i) for i in order, each only once fewer than caps[i] calls are running.

    The in-flight count is decremented as soon as a send returns, before the next is released, so
    at every send the calls running (that one included) number at most its cap. Returns the
    results in order.
    """
    cond = asyncio.Condition()
    in_flight = 0
    tasks: list[asyncio.Task] = []

    async def one(i: int):
        nonlocal in_flight
        try:
            return await send(i)
        finally:
            async with cond:
                in_flight -= 1
                cond.notify_all()

    for i, cap in enumerate(caps):
        async with cond:
            await cond.wait_for(lambda: in_flight < cap)
            in_flight += 1
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0)  # let it start (stamp its send) before the next is weighed
    return list(await asyncio.gather(*tasks))


def phase_metrics(results: list, phase_idx: list[int], phases: list[Phase], run_start: float,
                  percentiles=(90, 99), percentile_metrics=None, goodput: dict | None = None) -> list[dict]:
    """One dict per phase: its schedule, its span relative to the run's first send (start_s,
    end_s), and compute_metrics over its requests with that span as the duration."""
    from adaspec.bench import metrics

    kw = {"goodput": goodput}
    if percentile_metrics is not None:
        kw["percentile_metrics"] = percentile_metrics
    out = []
    for i, ph in enumerate(phases):
        mine = [r for r, p in zip(results, phase_idx) if p == i]
        first = min(r.send_time for r in mine)
        last = max(r.end_time for r in mine)
        d = {"phase": i, "max_concurrency": ph.max_concurrency, "num_requests": ph.num_requests,
             "start_s": first - run_start, "end_s": last - run_start}
        d.update(metrics.compute_metrics(mine, last - first, percentiles, **kw))
        out.append(d)
    return out
