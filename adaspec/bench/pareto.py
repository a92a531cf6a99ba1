"""The throughput / per-user-speed frontier: Pareto edge, distance to it, dominance beyond spread.

Pure functions on points (x = per-user tok/s, y = output tok/s; both better when higher).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass(frozen=True)
class Point:
    key: Hashable  # e.g. (arm, concurrency)
    x: float
    y: float
    x_std: float = 0.0
    y_std: float = 0.0


def pareto_edge(points: Iterable[Point]) -> list[Point]:
    """Points no other point matches or beats on both axes (strictly on one), sorted by x."""
    pts = list(points)
    edge = [
        p for p in pts
        if not any(q.x >= p.x and q.y >= p.y and (q.x > p.x or q.y > p.y) for q in pts)
    ]
    # Exact duplicates are both non-dominated; keep one so the edge has no repeated corner.
    seen, out = set(), []
    for p in sorted(edge, key=lambda p: (p.x, -p.y)):
        if (p.x, p.y) not in seen:
            seen.add((p.x, p.y))
            out.append(p)
    return out


def edge_gap(p: Point, edge: list[Point]) -> tuple[float, float]:
    """How far p is below the edge, in percent, as (throughput gap, per-user speed gap).

    Throughput gap: the best y any edge point reaches at a per-user speed >= p.x, versus p.y.
    Speed gap: the best x any edge point reaches at a throughput >= p.y, versus p.x.
    The edge is a staircase: nothing between measured points is assumed reachable. Points on the
    edge get (0, 0).
    """
    best_y = max((q.y for q in edge if q.x >= p.x), default=p.y)
    best_x = max((q.x for q in edge if q.y >= p.y), default=p.x)
    gy = 100.0 * (best_y - p.y) / best_y if best_y > 0 and best_y > p.y else 0.0
    gx = 100.0 * (best_x - p.x) / best_x if best_x > 0 and best_x > p.x else 0.0
    return min(gy, 100.0), min(gx, 100.0)  # rounding can overshoot 100 by an ulp


def dominated_beyond_spread(a: Point, b: Point) -> bool:
    """True when a is worse than b on BOTH axes by more than their spreads
    (a.mean + a.std < b.mean - b.std on x and on y), so noise cannot explain it."""
    return a.x + a.x_std < b.x - b.x_std and a.y + a.y_std < b.y - b.y_std


def dominance(points: list[Point]) -> dict:
    """key -> keys of the points that dominate it beyond spread (empty list: not dominated)."""
    return {a.key: [b.key for b in points if b is not a and dominated_beyond_spread(a, b)] for a in points}


def staircase(edge: list[Point]) -> tuple[list[float], list[float]]:
    """Polyline of the staircase edge for plotting (x ascending, y descending)."""
    xs, ys = [], []
    for i, p in enumerate(edge):
        if i:
            xs.append(edge[i - 1].x)
            ys.append(p.y)
        xs.append(p.x)
        ys.append(p.y)
    return xs, ys
