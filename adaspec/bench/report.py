"""`adaspec bench report DIR`: tables, frontier plot, per-concurrency verdict, conditions."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

from adaspec.bench import phase_report, point_conditions
from adaspec.bench.aggregate import Cell, aggregate, arms_in_order, load_points
from adaspec.bench.conditions import describe_hardware
from adaspec.bench.cost_check_report import cost_check_section
from adaspec.bench.merge import provenance_lines
from adaspec.bench.metrics import BURST_MIN_CHUNKS, BURST_S, CLIENT_BUSY_CPU_PER_WALL, client_busy
from adaspec.bench.pareto import dominance, edge_gap, pareto_edge
from adaspec.bench.plot import X, Y, cell_points, plot_frontier
from adaspec.errors import AdaspecError

SYNTHETIC_LABEL = "synthetic acceptance: timing only"  # = spec_decode/synthetic.py's LABEL (no torch import here)


class ReportError(AdaspecError):
    """A directory with nothing to report."""


def _num(v: float | None) -> str:
    if v is None:
        return "–"
    a = abs(v)
    return f"{v:.0f}" if a >= 1000 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 1 else f"{v:.3f}"


def mean_pm_std(cell: Cell | None, key: str, reps: int = 0) -> str:
    """Mean ± std over the cell's repeats; a cell with fewer repeats than `reps` (the sweep's most)
    says how many it has (an interrupted sweep can be reported)."""
    if cell is None or cell.mean.get(key) is None:
        return "–"
    s = f"{_num(cell.mean[key])} ± {_num(cell.std[key])}" if cell.n > 1 else _num(cell.mean[key])
    s += f" ({cell.n} of {reps} repeats)" if cell.n < reps else ""
    return s + (f" ({cell.failed} failed)" if cell.failed and key == Y else "")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


# A spread is known from this many repeats on: a cell with fewer has none (its std reads 0), so no
# dominance "beyond spread" is claimed by or against it.
MIN_REPEATS_FOR_SPREAD = 2


def verdict_lines(cells: dict[tuple[str, int], Cell], arms: list[str]) -> list[str]:
    """Per concurrency: arms dominated beyond spread, and each arm's distance to the global edge.
    A cell with fewer than MIN_REPEATS_FOR_SPREAD repeats has no spread: an arm worse on both axes
    where either side is such a cell is listed apart, never as dominated beyond spread."""
    pts = cell_points(cells)
    edge = pareto_edge(pts)
    on_edge = {p.key for p in edge}
    lines = []

    def known(key) -> bool:
        return cells[key].n >= MIN_REPEATS_FOR_SPREAD

    for c in sorted({k[1] for k in cells}):
        here = [p for p in pts if p.key[1] == c]
        if not here:
            continue
        dom = dominance(here)
        parts = []
        for arm in arms:
            p = next((q for q in here if q.key[0] == arm), None)
            if p is None:
                continue
            gy, gx = edge_gap(p, edge)
            where = "on the edge" if p.key in on_edge else f"{gy:.1f}% below in throughput, {gx:.1f}% below in per-user speed"
            parts.append(f"`{arm}` {where}")
        beyond = {a: [b for b in by if known(a) and known(b)] for a, by in dom.items()}
        unknown = {a: [b for b in by if not (known(a) and known(b))] for a, by in dom.items()}

        def listed(found):
            return [f"`{a[0]}` (by {', '.join(f'`{b[0]}`' for b in by)})" for a, by in found.items() if by]

        doms, worse = listed(beyond), listed(unknown)
        head = f"- **C={c}**: dominated beyond spread: {', '.join(doms) if doms else 'none'}."
        if worse:
            head += (f" Worse on both axes, spread unknown (a cell with fewer than {MIN_REPEATS_FOR_SPREAD} "
                     f"repeats): {', '.join(worse)}.")
        lines.append(head + " Distance to the edge: " + "; ".join(parts) + ".")
    return lines


def fewer_repeats_line(cells: dict[tuple[str, int], Cell]) -> str | None:
    """A warning naming the cells with fewer repeats than the sweep's most (e.g. an interrupted sweep)."""
    reps = max((c.n for c in cells.values()), default=0)
    short = [c for c in cells.values() if c.n < reps]
    if not short:
        return None
    names = ", ".join(f"{c.arm} at C={c.concurrency} ({c.n})" for c in short)
    one = any(c.n < MIN_REPEATS_FOR_SPREAD for c in short)
    return (f"- cells with fewer repeats than the others' {reps}: {names}. Their means rest on fewer runs"
            + ("; with one repeat a cell has no spread, so no dominance beyond spread is claimed by or against it."
               if one else "."))


def conditions_lines(manifest: dict | None, points: list[dict] | None = None) -> list[str]:
    """From the points when they record their conditions (they are what was measured), else
    from the manifest (sweeps from before points recorded them)."""
    if points and any(p.get("conditions") for p in points):
        m = manifest or {}
        concs = sorted({p.get("concurrency") for p in points if p.get("concurrency") is not None})
        return point_conditions.lines(points, describe_hardware) + [
            (f"- concurrency: {concs}; " if concs else "- ") + "repeats: up to "
            f"{max(p.get('repeat', 0) for p in points) + 1}",
            f"- started {m.get('start_time')}, ended {m.get('end_time')}",
        ] + provenance_lines(m)
    if not manifest:
        return ["(no manifest.json: conditions unknown)"]
    m = manifest
    hw = m.get("hardware") or {}
    lines = [
        f"- hardware: {describe_hardware(hw) if hw else 'unknown'}",
        f"- model: `{m.get('model')}`; drafter: `{m.get('drafter')}`",
        f"- engine commit: `{m.get('engine_commit')}`",
        f"- prompts: {json.dumps(m.get('prompts'))}",
        f"- output length: {m.get('output_len')} tokens (ignore_eos: {m.get('ignore_eos')}); "
        f"temperature: {m.get('temperature')}; endpoint: {m.get('endpoint')}",
        f"- repeats: {m.get('repeats')}; concurrency: {m.get('concurrency')}; warm-up requests per point: {m.get('num_warmups')}",
        f"- started {m.get('start_time')}, ended {m.get('end_time')}",
        "- arms:",
    ]
    for a in m.get("arms", []):
        where = f" at {a['base_url']} (not started by the sweep)" if a.get("base_url") else ""
        lines.append(f"  - `{a['name']}`: speculative_config = `{json.dumps(a.get('speculative_config'))}`{where}")
    return lines


def synthetic_arms(points: list[dict], manifest: dict | None = None) -> dict[str, str]:
    """Arms whose acceptance was synthetic -> the note to show: from the server's /metrics note
    in the point, or from the speculative_config the point (or the manifest) records."""
    found: dict[str, str] = {}
    for p in points:
        spec = ((p.get("conditions") or {}).get("arm") or {}).get("speculative_config")
        if p.get("spec_synthetic_acceptance") or (isinstance(spec, dict) and spec.get("method") == "synthetic"):
            found[str(p.get("arm"))] = p.get("spec_synthetic_acceptance") or SYNTHETIC_LABEL
    for a in (manifest or {}).get("arms", []):
        spec = a.get("speculative_config")
        if isinstance(spec, dict) and spec.get("method") == "synthetic":
            found.setdefault(str(a.get("name")), SYNTHETIC_LABEL)
    return found


def synthetic_banner(synthetic: dict[str, str]) -> list[str]:
    if not synthetic:
        return []
    note = next(iter(synthetic.values()))
    arms = ("Arms " if len(synthetic) > 1 else "Arm ") + ", ".join(f"`{a}`" for a in sorted(synthetic))
    return [f"**{note}.** {arms} drew draft acceptance from a configured curve (speculative_config "
            "`synthetic_acceptance`), not from the target: their throughput and per-user speed are step costs at "
            "that acceptance, and their output is not the target's distribution.", ""]


def build_markdown(out_dir: Path, manifest: dict | None, points: list[dict], png_name: str = "frontier.png") -> str:
    cells = aggregate(points)
    arms = arms_in_order(points, manifest)
    concs = sorted({c for _, c in cells})
    reps = max((c.n for c in cells.values()), default=0)
    md = ["# adaspec benchmark report", ""] + synthetic_banner(synthetic_arms(points, manifest))
    md += ["## Conditions", ""] + conditions_lines(manifest, points) + [""]
    spread = f"mean ± sample std over {reps} repeats" if reps > 1 else "one repeat, no spread"
    md += [f"## Output throughput (tok/s, {spread})", ""]
    md += table(["C"] + arms, [[str(c)] + [mean_pm_std(cells.get((a, c)), Y, reps) for a in arms] for c in concs]) + [""]
    md += [f"## Per-user speed (tok/s, median over requests; {spread})", ""]
    md += table(["C"] + arms, [[str(c)] + [mean_pm_std(cells.get((a, c)), X, reps) for a in arms] for c in concs]) + [""]
    md += ["## Latency (ms, mean over repeats): TTFT p50 / TTFT p99 / ITL p99 (per chunk)", ""]

    def lat(cell):
        if cell is None:
            return "–"
        return " / ".join(_num(cell.mean.get(k)) for k in ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms"))

    md += table(["C"] + arms, [[str(c)] + [lat(cells.get((a, c))) for a in arms] for c in concs]) + [""]
    if any(cl.mean.get("spec_acceptance_rate") is not None for cl in cells.values()):
        md += ["## Speculation (from /metrics): acceptance rate / mean accepted length / accepted drafts per "
               "predicted (the confidences' calibration on this traffic: 1 = calibrated, < 1 = they promise too much)", ""]

        def spec(cell):
            if cell is None or cell.mean.get("spec_acceptance_rate") is None:
                return "–"
            ratio = cell.mean.get("spec_calibration_ratio")
            return (f"{cell.mean['spec_acceptance_rate']:.3f} / {_num(cell.mean.get('spec_mean_accepted_length'))} / "
                    f"{'–' if ratio is None else f'{ratio:.2f}'}")

        md += table(["C"] + arms, [[str(c)] + [spec(cells.get((a, c))) for a in arms] for c in concs]) + [""]
    if any(cl.mean.get("engine_steps") is not None for cl in cells.values()):
        md += ["## Engine steps (from /metrics, mean over repeats): mean step ms / output tokens per step / "
               "share of the run's wall time inside steps", ""]
        md += ["A share well under 1 at a high concurrency means the engine's loop around its steps (taking "
               "requests, sending news) or the HTTP side, not the steps, held the run back.", ""]

        def steps(cell):
            if cell is None or cell.mean.get("engine_steps") is None:
                return "–"
            m, busy = cell.mean, cell.mean.get("engine_busy_fraction")
            return (f"{_num(m.get('engine_mean_step_ms'))} / {_num(m.get('engine_output_tokens_per_step'))} / "
                    f"{'–' if busy is None else f'{busy:.2f}'}")

        md += table(["C"] + arms, [[str(c)] + [steps(cells.get((a, c))) for a in arms] for c in concs]) + [""]
    md += cost_check_section(points, arms)
    md += ["## Frontier", "", f"![frontier]({png_name})", ""]
    md += ["x = per-user speed, y = output throughput; dashed: the Pareto edge over all arms "
           "(a staircase: only measured points are taken as reachable).", ""]
    md += ["## Verdict per concurrency", ""]
    md += ["Dominated beyond spread = worse on both axes than another arm at the same concurrency, "
           "by more than both spreads (mean + std < other's mean − std). Distance to the edge: how much "
           "less throughput than the best point at least as fast per user, and how much slower per user "
           "than the best point with at least as much throughput.", ""]
    if reps < MIN_REPEATS_FOR_SPREAD:
        md += ["With one repeat there is no spread: no arm is dominated beyond spread here; arms worse on both axes "
               "are listed as such, to read as indicative only. Rerun with --repeats 3 before drawing conclusions.", ""]
    md += verdict_lines(cells, arms) + [""]
    failed = sum(c.failed for c in cells.values())
    missing = sum(c.usage_missing for c in cells.values())
    no_finish = sum(int(p.get("streams_without_finish_reason") or 0) for p in points)
    mixed = point_conditions.mixed_settings(points)
    bursts = burst_line({f"{c.arm} at C={c.concurrency}": (c.burst_delivered, c.completed) for c in cells.values()})
    busy = busy_client_line({f"{c.arm} at C={c.concurrency}": c.client_cpu_per_wall for c in cells.values()})
    md += warnings_section([
        mixed and (f"- the points were measured under different settings ({', '.join(mixed)}): "
                   "see Conditions; compare only points measured alike."),
        failed_line(failed),
        fewer_repeats_line(cells),
        missing and f"- {missing} responses had no usage chunk; their tokens were counted as chunks (too low under speculation).",
        no_finish and (f"- {no_finish} streams ended in `data: [DONE]` without a finish_reason on any chunk; counted as "
                       "complete (as vLLM's client does), though nothing in them said the answer was whole."),
        bursts, busy,
    ])
    return "\n".join(md)


def warnings_section(lines: list) -> list[str]:
    """A "## Warnings" section of the lines given (falsy ones left out), or nothing when none is left."""
    kept = [ln for ln in lines if ln]
    return ["## Warnings", ""] + kept + [""] if kept else []


def failed_line(failed: int) -> str | None:
    return (f"- {failed} requests failed in total; failed requests add no tokens (see the point files' `errors`)."
            if failed else None)


def burst_line(counts: dict[str, tuple[int, int]]) -> str | None:
    """A warning naming where streams were flushed in one burst (label -> (bursts, completed)), or None."""
    hit = [f"{label} {b} of {n}" for label, (b, n) in counts.items() if b]
    if not hit:
        return None
    return (f"- streams delivered in one burst after a wait (at least {BURST_MIN_CHUNKS} chunks, all within "
            f"{BURST_S * 1e3:g} ms of the first): {', '.join(hit)}. Their per-user speed measures the flush (the "
            "server or the client was busy), not the decoding, and pulls the medians up; their wait is in TTFT.")


def busy_client_line(cpu: dict[str, float | None]) -> str | None:
    """A warning naming where the benchmark client was CPU-bound (label -> its CPU s per wall s), or None."""
    hit = [f"{label} {v:.2f}" for label, v in cpu.items() if client_busy(v)]
    if not hit:
        return None
    return (f"- the benchmark client was CPU-bound (CPU seconds per wall second of its process, at least "
            f"{CLIENT_BUSY_CPU_PER_WALL:g}): {', '.join(hit)}. It read the streams late, so chunk times, per-user "
            "speeds and TTFT there include its own lag; split the load over several client processes or use a "
            "faster host.")


def md_to_html(md: str, title: str = "adaspec benchmark report") -> str:
    """HTML for the Markdown subset build_markdown writes (headings, tables, lists, images)."""

    def inline(s: str) -> str:
        s = html.escape(s)
        s = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", r'<img alt="\1" src="\2" style="max-width:100%">', s)
        s = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", s)
        return re.sub(r"`([^`]+)`", r"<code>\1</code>", s)

    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
           "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>"]
    lines = md.split("\n")
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("#"):
            level = len(ln) - len(ln.lstrip("#"))
            out.append(f"<h{level}>{inline(ln[level:].strip())}</h{level}>")
        elif ln.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            out.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in rows[0]) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in rows[2:]]
            out.append("</table>")
            continue
        elif ln.lstrip().startswith("- "):
            out.append("<ul>")
            while i < len(lines) and lines[i].lstrip().startswith("- "):
                out.append(f"<li>{inline(lines[i].lstrip()[2:])}</li>")
                i += 1
            out.append("</ul>")
            continue
        elif ln.strip():
            out.append(f"<p>{inline(ln)}</p>")
        i += 1
    out.append("</body></html>")
    return "\n".join(out)


def read_manifest(out_dir: Path) -> dict | None:
    p = out_dir / "manifest.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_report(out_dir: str | Path, html_too: bool = False) -> dict:
    """Writes report.md and frontier.png (and report.html); returns their paths and the Markdown."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise ReportError(f"{out_dir} is not a directory")
    points = load_points(out_dir)
    if not points:
        raise ReportError(f"no complete point files in {out_dir / 'points'}; run `adaspec bench sweep --out {out_dir}` first")
    manifest = read_manifest(out_dir)
    arms = arms_in_order(points, manifest)
    title = f"{(manifest or {}).get('model', '')}: throughput vs per-user speed"
    if synthetic_arms(points, manifest):
        title += f"\n({SYNTHETIC_LABEL})"
    if phase_report.is_phased(points):
        if not all(p.get("load_phases") for p in points):
            raise ReportError(f"{out_dir / 'points'} mixes moving-load points with fixed-concurrency points; "
                              "report them from separate directories")
        whole, per = phase_report.aggregate_phased(points)
        png = phase_report.plot_phased(whole, per, arms, out_dir / "frontier.png", title=title)
        md = phase_report.build_markdown(manifest, points, png.name)
    else:
        png = plot_frontier(aggregate(points), arms, out_dir / "frontier.png", title=title)
        md = build_markdown(out_dir, manifest, points, png.name)
    md_path = out_dir / "report.md"
    md_path.write_text(md + "\n", encoding="utf-8")
    res = {"markdown": md, "report_md": md_path, "frontier_png": png}
    if html_too:
        h = out_dir / "report.html"
        h.write_text(md_to_html(md), encoding="utf-8")
        res["report_html"] = h
    return res
