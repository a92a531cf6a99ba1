"""The frontier plot: per-user tok/s (x) against output tok/s (y), one line per arm."""
from __future__ import annotations

from pathlib import Path

from adaspec.bench.aggregate import Cell
from adaspec.bench.pareto import Point, pareto_edge, staircase

X, Y = "median_per_user_tok_s", "output_throughput"


def cell_points(cells: dict[tuple[str, int], Cell]) -> list[Point]:
    """(arm, concurrency) cells that have both coordinates, as Pareto points with their spread."""
    pts = []
    for (arm, c), cell in cells.items():
        x, y = cell.mean.get(X), cell.mean.get(Y)
        if x is None or y is None:
            continue
        pts.append(Point((arm, c), x, y, cell.std.get(X) or 0.0, cell.std.get(Y) or 0.0))
    return pts


def arm_color(arm: str) -> tuple:
    """One colour per arm name in every plot, whatever other arms share it: grey for `none`, blues
    for fixed:K and oranges for adaptive:K (darker for larger K), a stable pick for other labels."""
    import zlib

    from matplotlib import colormaps

    kind, _, k = arm.partition(":")
    if arm == "none":
        return colormaps["Greys"](0.75)
    if kind in ("fixed", "adaptive") and k.isdigit():
        shade = 0.35 + 0.6 * min(int(k), 16) / 16
        return colormaps["Blues" if kind == "fixed" else "Oranges"](shade)
    return colormaps["tab10"](zlib.crc32(arm.encode()) % 10)  # crc32: the same across runs, unlike hash()


# what a point's bars are (bench/aggregate.py: the spread over repeats)
ERROR_BARS = "points: mean over repeats; bars: +/- 1 sample std (n - 1) over repeats"


def plot_frontier(cells: dict[tuple[str, int], Cell], arms: list[str], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt
    from adaspec.figures import save_png

    pts = cell_points(cells)
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for arm in arms:
        mine = sorted((p for p in pts if p.key[0] == arm), key=lambda p: p.key[1])
        if not mine:
            continue
        line = ax.errorbar([p.x for p in mine], [p.y for p in mine], xerr=[p.x_std for p in mine],
                           yerr=[p.y_std for p in mine], marker="o", capsize=3, label=arm, color=arm_color(arm))
        for p in mine:
            ax.annotate(f"C={p.key[1]}", (p.x, p.y), textcoords="offset points", xytext=(5, 4),
                        fontsize=7, color=line[0].get_color())
    edge = pareto_edge(pts)
    if edge:
        xs, ys = staircase(edge)
        ax.plot(xs, ys, linestyle="--", color="black", linewidth=1.2, alpha=0.7, label="Pareto edge (all arms)")
        # Rings mark the edge's points, so a one-point edge is visible too.
        ax.scatter([p.x for p in edge], [p.y for p in edge], s=140, facecolors="none", edgecolors="black",
                   linewidths=1.0, zorder=3)
    ax.set_xlabel("per-user speed, tok/s (median over requests)")
    ax.set_ylabel("output throughput, tok/s")
    ax.set_title(title or "Throughput vs per-user speed")
    ax.annotate(ERROR_BARS, (0.01, 0.01), xycoords="figure fraction", fontsize=7, color="0.35")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path)
    plt.close(fig)
    return path
