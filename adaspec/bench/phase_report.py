"""The report of a moving-load sweep (`adaspec bench sweep --load-phases`): per arm, the whole run
and every phase (output throughput, per-user speed p50/p90, TTFT p50/p99), mean ± sample std over
repeats, and whether each adaptive arm beats every other arm on throughput at equal or better
per-user speed (the moving-load question), beyond the spread between repeats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adaspec.bench.aggregate import mean_std
from adaspec.bench.cost_check_report import cost_check_section

# (key, column title) of each table.
COLUMNS = (
    ("output_throughput", "output tok/s"),
    ("median_per_user_tok_s", "per-user tok/s p50"),
    ("p90_per_user_tok_s", "per-user tok/s p90"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
)
THROUGHPUT, SPEED = "output_throughput", "median_per_user_tok_s"


@dataclass
class Stats:
    """One arm's numbers over its repeats: the whole run, or one phase."""
    n: int = 0
    failed: int = 0
    mean: dict = field(default_factory=dict)
    std: dict = field(default_factory=dict)


def is_phased(points: list[dict]) -> bool:
    return any(p.get("load_phases") for p in points)


def _stats(results: list[dict]) -> Stats:
    s = Stats(n=len(results), failed=sum(int(r.get("failed") or 0) for r in results))
    for key, _ in COLUMNS + (("start_s", ""), ("end_s", "")):
        s.mean[key], s.std[key] = mean_std([r.get(key) for r in results])
    return s


def aggregate_phased(points: list[dict]) -> tuple[dict[str, Stats], dict[tuple[str, int], Stats]]:
    """(arm -> whole-run Stats, (arm, phase index) -> that phase's Stats)."""
    whole: dict[str, list[dict]] = {}
    per: dict[tuple[str, int], list[dict]] = {}
    for p in points:
        whole.setdefault(p["arm"], []).append(p)
        for ph in p.get("phases") or []:
            per.setdefault((p["arm"], int(ph["phase"])), []).append(ph)
    return {a: _stats(v) for a, v in whole.items()}, {k: _stats(v) for k, v in per.items()}


def _num(v) -> str:
    from adaspec.bench.report import _num as num

    return num(v)


def cell(s: Stats | None, key: str) -> str:
    if s is None or s.mean.get(key) is None:
        return "–"
    return f"{_num(s.mean[key])} ± {_num(s.std[key])}" if s.n > 1 else _num(s.mean[key])


def _table(rows: dict[str, Stats | None], arms: list[str], reps: int) -> list[str]:
    from adaspec.bench.report import table

    body = []
    for arm in arms:
        s = rows.get(arm)
        fail = f" ({s.failed} failed)" if s is not None and s.failed else ""
        # a sweep stopped early can leave an arm with fewer repeats than the others
        fewer = f" ({s.n} of {reps} repeats)" if s is not None and s.n < reps else ""
        body.append([f"`{arm}`{fewer}{fail}"] + [cell(s, k) for k, _ in COLUMNS])
    return table(["arm"] + [t for _, t in COLUMNS], body)


def compare(a: Stats, b: Stats) -> dict:
    """How arm a stands against arm b: relative differences (%) and whether each is beyond the
    spread (a.mean - a.std > b.mean + b.std for 'higher', the mirror for 'lower'). Where either arm
    has fewer than 2 repeats there is no spread to judge by: the side is the means' alone, marked
    "spread unknown" (never "higher" or "lower" beyond spread)."""
    from adaspec.bench.report import MIN_REPEATS_FOR_SPREAD

    unknown = min(a.n, b.n) < MIN_REPEATS_FOR_SPREAD
    out = {}
    for key in (THROUGHPUT, SPEED):
        ma, mb = a.mean.get(key), b.mean.get(key)
        if ma is None or mb is None or not mb:
            out[key] = None
            continue
        if unknown:
            side = ("higher" if ma > mb else "lower" if ma < mb else "equal") + ", spread unknown"
        else:
            sa, sb = a.std.get(key) or 0.0, b.std.get(key) or 0.0
            side = "higher" if ma - sa > mb + sb else "lower" if ma + sa < mb - sb else "within spread"
        out[key] = {"pct": 100.0 * (ma - mb) / mb, "side": side, "spread_unknown": unknown}
    return out


def goal_lines(whole: dict[str, Stats], arms: list[str], reps: int) -> list[str]:
    """Per adaptive arm against every other arm, over the whole run: the goal is more output
    throughput beyond the spread, with median per-user speed not lower beyond the spread."""
    lines = []
    adaptive = [a for a in arms if a.startswith("adaptive")]
    if not adaptive:
        return ["- no adaptive arm in this sweep: nothing to hold against the goal."]
    for ad in adaptive:
        verdicts = []
        met = met_on_means = True
        for other in arms:
            if other == ad or other not in whole or ad not in whole:
                continue
            c = compare(whole[ad], whole[other])
            t, v = c[THROUGHPUT], c[SPEED]
            if t is None or v is None:
                verdicts.append(f"`{other}`: not measured")
                met = met_on_means = False
                continue
            on_means = t["side"].startswith("higher") and not v["side"].startswith("lower")
            ok = on_means and not t["spread_unknown"]
            met &= ok
            met_on_means &= on_means
            said = "beats it" if ok else "beats it on the means only" if on_means else "does not beat it"
            verdicts.append(f"`{other}`: output throughput {t['pct']:+.1f}% ({t['side']}), median per-user speed "
                            f"{v['pct']:+.1f}% ({v['side']}) -> {said}")
        if not verdicts:
            continue
        verdict = "meets" if met else "meets on the means only, not beyond spread," if met_on_means else "does not meet"
        head = (f"- **`{ad}` {verdict} the goal** (more output throughput than every other "
                f"arm beyond the spread, at a median per-user speed not lower beyond the spread) over the whole run:")
        lines.append(head)
        lines += [f"  - {v}" for v in verdicts]
    if reps <= 1:
        lines.append("- With one repeat there is no spread: nothing is beyond spread here, only the means compare; "
                     "rerun with --repeats 3 before drawing conclusions.")
    elif any(s.n < 2 for s in whole.values()):
        lines.append("- An arm with one repeat (a sweep stopped early) has no spread: against it only the means "
                     "compare (\"spread unknown\").")
    return lines


def build_markdown(manifest: dict | None, points: list[dict], png_name: str = "frontier.png") -> str:
    from adaspec.bench.aggregate import arms_in_order
    from adaspec.bench.report import burst_line, busy_client_line, conditions_lines, failed_line, warnings_section

    whole, per = aggregate_phased(points)
    arms = arms_in_order(points, manifest)
    schedule = next(p["load_phases"] for p in points if p.get("load_phases"))
    phases = sorted({int(ph["phase"]) for p in points for ph in p.get("phases") or []})
    reps = max((s.n for s in whole.values()), default=0)
    spread = f"mean ± sample std over {reps} repeats" if reps > 1 else "one repeat, no spread"
    md = ["# adaspec benchmark report: a load that moves", ""]
    md += ["## Conditions", ""] + conditions_lines(manifest, points) + [""]
    md += [f"Every arm ran the same schedule of phases, `{schedule}` (concurrency x requests, in order, in one run "
           "against one server): a request of a phase is sent only while fewer than that phase's concurrency are in "
           "flight. A phase's numbers are over its own requests, its duration from its first send to its last "
           "completion (phases overlap where one drains while the next starts). Per-user speed = (output tokens - 1) "
           "/ (E2EL - TTFT) per request.", ""]
    md += [f"## Whole run ({spread})", ""] + _table(whole, arms, reps) + [""]
    for i in phases:
        ref = next((ph for p in points for ph in p.get("phases") or [] if int(ph["phase"]) == i), {})
        span = [per[(a, i)] for a in arms if (a, i) in per]
        when = (f"; from {_num(min(s.mean['start_s'] for s in span))} s to {_num(max(s.mean['end_s'] for s in span))} s "
                "after the run's first request (mean over repeats, earliest and latest arm)") if span else ""
        md += [f"## Phase {i}: concurrency {ref.get('max_concurrency')} x {ref.get('num_requests')} requests{when}", ""]
        md += _table({a: per.get((a, i)) for a in arms}, arms, reps) + [""]
    md += ["## Frontier", "", f"![frontier]({png_name})", "",
           "x = median per-user speed, y = output throughput; large markers: the whole run, small ones: each phase.", ""]
    md += ["## The moving-load question", ""] + goal_lines(whole, arms, reps) + [""]
    # the served steps against the tables, every phase's together (the counters are the server's, per run)
    md += cost_check_section(points, arms)
    failed = sum(s.failed for s in whole.values())
    counts: dict[str, tuple[int, int]] = {}
    for p in points:  # whole runs, all repeats of an arm together
        b, n = counts.get(p["arm"], (0, 0))
        counts[p["arm"]] = (b + int(p.get("burst_delivered_requests") or 0), n + int(p.get("completed") or 0))
    bursts = burst_line(counts)
    cpu: dict[str, float | None] = {}
    for p in points:  # the busiest repeat of each arm's client
        v = p.get("client_cpu_per_wall")
        if v is not None:
            cpu[p["arm"]] = max(v, cpu.get(p["arm"]) or 0.0)
    md += warnings_section([failed_line(failed), bursts, busy_client_line(cpu)])
    return "\n".join(md)


def plot_phased(whole: dict[str, Stats], per: dict[tuple[str, int], Stats], arms: list[str], path: Path,
                title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from adaspec.figures import save_png

    from adaspec.bench.plot import ERROR_BARS, arm_color

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for arm in arms:
        col = arm_color(arm)
        s = whole.get(arm)
        if s and s.mean.get(SPEED) is not None and s.mean.get(THROUGHPUT) is not None:
            ax.errorbar([s.mean[SPEED]], [s.mean[THROUGHPUT]], xerr=[s.std[SPEED] or 0], yerr=[s.std[THROUGHPUT] or 0],
                        marker="o", markersize=9, capsize=3, color=col, label=f"{arm} (whole run)", linestyle="none")
        for (a, i), ps in sorted(per.items()):
            if a != arm or ps.mean.get(SPEED) is None or ps.mean.get(THROUGHPUT) is None:
                continue
            ax.scatter([ps.mean[SPEED]], [ps.mean[THROUGHPUT]], s=18, marker="s", color=col)
            ax.annotate(f"phase {i}", (ps.mean[SPEED], ps.mean[THROUGHPUT]), textcoords="offset points",
                        xytext=(4, 3), fontsize=7, color=col)
    ax.set_xlabel("per-user speed, tok/s (median over requests)")
    ax.set_ylabel("output throughput, tok/s")
    ax.set_title(title or "A load that moves: whole run and phases")
    ax.annotate(ERROR_BARS, (0.01, 0.01), xycoords="figure fraction", fontsize=7, color="0.35")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    save_png(fig, path)
    plt.close(fig)
    return path
