"""The facts a published figure must name: hardware, engine commit, time."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict:
    """GPU name and count when torch sees CUDA, else the CPU model and core count."""
    info: dict = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "gpu": None, "gpu_count": 0}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # torch missing or broken CUDA: still a valid CPU description
        pass
    return info


def host_speed(repeats: int = 5) -> dict:
    """How fast this host runs the engine's kind of host work: the median wall milliseconds of a fixed
    pure-Python workload (dicts, lists and small-int arithmetic, as the scheduler's bookkeeping does)
    on one thread, with the CPU model. An engine loop that keeps one core busy is as fast as this:
    H200 runs 15 and 16 spent 1.4-1.5x run 14's host time per no-spec step on the same code, and
    only a measured figure tells a slower host CPU from a slower engine. ~0.1 s."""
    def work() -> int:
        table: dict[int, list[int]] = {}
        for i in range(20_000):
            row = table.setdefault(i & 255, [])
            row.append(i * 7 % 13)
            if len(row) > 8:
                row.pop(0)
        return sum(len(v) for v in table.values())

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"cpu": cpu_model(), "python_loop_ms": round(statistics.median(times), 3)}


COMMIT_ENV = "ADASPEC_COMMIT"
DIRTY = "-dirty (unverified)"  # the mark of a checkout whose tracked files differ from its commit


def engine_commit(root: Path | None = None) -> str | None:
    """The adaspec commit measured: $ADASPEC_COMMIT when the caller sets it (a copied checkout,
    as on a remote GPU machine, can carry a stale .git), else `git rev-parse HEAD` of the
    checkout, marked "-dirty (unverified)" when tracked files differ from that commit."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return given
    root = root or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + (DIRTY if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def describe_hardware(h: dict) -> str:
    if h.get("gpu"):
        return f"{h['gpu_count']} x {h['gpu']} (host CPU: {h.get('cpu')}, {h.get('cpu_cores')} cores)"
    return f"CPU only: {h.get('cpu')}, {h.get('cpu_cores')} cores"
