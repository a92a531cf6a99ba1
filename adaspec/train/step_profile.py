"""Where a training step's time goes: torch.profiler over a few steps, then the kernels (on CUDA;
the CPU ops elsewhere) ranked by their own time, against the steps' wall time.

Used for the drafter's training steps and the self-distillation's decode steps (the build's two
stages whose time is not the target's training). Why: the code-0.6b build's drafter stage fills its
2.5 minutes with ~2,600 steps of ~59 ms (H200 runs 18-27), and the build as a whole (399-444 s)
misses issue 13's 4-5 minutes; a step's target forward, drafter pass and loss add up to less than
59 ms on paper. This names the kernels before anything is
optimized, inside the build itself (the GPU machine keeps nothing between commands, so a separate
profiling run would pay the build again). Written to OUT/step_profile.json and .txt; `adaspec train
pair` copies the summary into pair.json.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch


class StepProfile:
    """Profile training steps [start, start + steps): call maybe_start(step) before each step and
    maybe_stop(step) after it (step = the steps done so far)."""

    def __init__(self, steps: int, start: int, device: torch.device, out_dir: Path):
        self.steps, self.start, self.device, self.out_dir = steps, start, device, Path(out_dir)
        self._prof = None
        self._t0 = 0.0
        self.summary: dict | None = None

    def maybe_start(self, step: int) -> None:
        """Once only: a loop that runs its steps again (another batch) is not profiled twice."""
        if self.steps <= 0 or step != self.start or self._prof is not None or self.summary is not None:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        try:
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        except Exception as e:  # noqa: BLE001 - a measurement must never stop the build it measures
            self.summary = {"error": f"{type(e).__name__}: {e}", "first_step": self.start}
            self._write()
            return
        self._prof = prof
        self._t0 = time.perf_counter()

    def maybe_stop(self, step: int) -> dict | None:
        """After the last profiled step: stop, summarize, write the files. -> the summary or None."""
        if self._prof is None or step != self.start + self.steps:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            self.summary = summarize(prof.key_averages(), self.steps, wall, on_device=self.device.type == "cuda")
        except Exception as e:  # noqa: BLE001 - as in maybe_start
            self.summary = {"error": f"{type(e).__name__}: {e}"}
        self.summary["first_step"] = self.start
        self._write()
        return self.summary

    def _write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "step_profile.json").write_text(json.dumps(self.summary, indent=1))
        (self.out_dir / "step_profile.txt").write_text(format_summary(self.summary) + "\n")


def _own_time_us(event, on_device: bool) -> float:
    if on_device:  # the attribute's name changed across torch versions
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
    return float(event.self_cpu_time_total)


def summarize(events, steps: int, wall_s: float, on_device: bool, top: int = 12) -> dict:
    """events: a profiler's key_averages(). On the device, kernels only (the ops that launch them
    report the same time again); on the CPU, every op's own time."""
    rows = []
    for e in events:
        if on_device and getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        t = _own_time_us(e, on_device)
        if t > 0:
            rows.append((e.key, t, int(e.count)))
    total = sum(t for _, t, _ in rows)
    rows.sort(key=lambda r: -r[1])
    return {
        "steps": steps,
        "timer": "CUDA kernels" if on_device else "CPU ops",
        "wall_ms_per_step": round(1e3 * wall_s / steps, 3),
        "timed_ms_per_step": round(total / steps / 1e3, 3),  # kernels' busy time on the device
        "top": [{"name": name[:120], "ms_per_step": round(t / steps / 1e3, 3), "calls_per_step": round(n / steps, 2),
                 "share": round(t / total, 4) if total else 0.0} for name, t, n in rows[:top]],
    }


def format_summary(s: dict) -> str:
    if "error" in s:
        return f"step profile failed: {s['error']}"
    lines = [f"{s['steps']} steps from step {s.get('first_step', '?')}: {s['wall_ms_per_step']:.2f} ms wall per step, "
             f"{s['timed_ms_per_step']:.2f} ms of {s['timer']} per step",
             f"{'ms/step':>9} {'share':>6} {'calls':>6}  name"]
    for r in s["top"]:
        lines.append(f"{r['ms_per_step']:>9.3f} {100 * r['share']:>5.1f}% {r['calls_per_step']:>6.1f}  {r['name']}")
    return "\n".join(lines)
