"""Point files of a sweep -> mean and spread per (arm, concurrency) over repeats."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from adaspec.errors import AdaspecError

# The quantities the report aggregates (keys of one point's result JSON).
KEYS = [
    "output_throughput",
    "median_per_user_tok_s",
    "p10_per_user_tok_s",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_itl_token_ms",
    "p99_itl_token_ms",
    "median_tpot_ms",
    "spec_acceptance_rate",
    "engine_steps",
    "engine_mean_step_ms",
    "engine_output_tokens_per_step",
    "engine_busy_fraction",
    "spec_mean_accepted_length",
    "spec_calibration_ratio",
    "spec_cost_ratio",
]


@dataclass
class Cell:
    arm: str
    concurrency: int
    n: int = 0  # repeats aggregated
    failed: int = 0
    completed: int = 0
    usage_missing: int = 0
    burst_delivered: int = 0  # streams flushed in one burst (metrics.BURST_S), over the repeats
    client_cpu_per_wall: float | None = None  # the busiest repeat's client (metrics.CLIENT_BUSY_CPU_PER_WALL)
    mean: dict = field(default_factory=dict)  # key -> mean over repeats (None if never measured)
    std: dict = field(default_factory=dict)  # key -> sample std (ddof=1; 0.0 for one repeat)


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n-1): the spread between repeats, not within a run."""
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return None, None
    m = sum(v) / len(v)
    if len(v) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


class PointFileError(AdaspecError):
    """A complete point file without what the report groups points by."""


def load_points(out_dir: str | Path) -> list[dict]:
    """The complete points of a sweep directory; one missing its arm or concurrency (a file not
    written by a sweep, or edited) is refused naming the file and the key."""
    pts = []
    for p in sorted(Path(out_dir, "points").glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a torn file from an interrupted run; the sweep redoes it
        if not isinstance(d, dict) or not d.get("complete"):
            continue
        for key in ("arm", "concurrency"):
            if key not in d:
                raise PointFileError(f"{p}: a complete point without the key {key!r} (every point a sweep writes "
                                     "has it; move the file out of the points folder or add the key)")
        c = d["concurrency"]
        if c is not None and (isinstance(c, bool) or not isinstance(c, int)):
            raise PointFileError(f"{p}: 'concurrency' is {c!r}, not a whole number (or null for a moving load)")
        pts.append(d)
    return pts


def aggregate(points: list[dict]) -> dict[tuple[str, int], Cell]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for p in points:
        groups.setdefault((p["arm"], int(p["concurrency"])), []).append(p)
    cells = {}
    for (arm, c), ps in groups.items():
        cell = Cell(arm, c, n=len(ps))
        cell.failed = sum(int(p.get("failed") or 0) for p in ps)
        cell.completed = sum(int(p.get("completed") or 0) for p in ps)
        cell.usage_missing = sum(int(p.get("usage_missing_requests") or 0) for p in ps)
        cell.burst_delivered = sum(int(p.get("burst_delivered_requests") or 0) for p in ps)
        cell.client_cpu_per_wall = max((p["client_cpu_per_wall"] for p in ps if p.get("client_cpu_per_wall") is not None),
                                       default=None)
        for k in KEYS:
            cell.mean[k], cell.std[k] = mean_std([p.get(k) for p in ps])
        cells[(arm, c)] = cell
    return cells


def arms_in_order(points: list[dict], manifest: dict | None) -> list[str]:
    """The manifest's arm order (as the user listed them), then any other arm found."""
    order = [a["name"] for a in (manifest or {}).get("arms", [])]
    for p in points:
        if p["arm"] not in order:
            order.append(p["arm"])
    return [a for a in order if any(p["arm"] == a for p in points)]
