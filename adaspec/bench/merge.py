"""`adaspec bench merge`: one report from the repeats of several sweeps measured under the same
conditions, e.g. two commands on one GPU machine that each ran 2 repeats of the same schedule.

Why: the spread within one command understates the spread between commands (H200 run 32: fixed:3's
whole-run throughput moved 1.5% between two commands on one build, beyond either command's spread),
so a verdict wants the repeats of several commands. A merge is only as honest as the match of its
sources, so it is refused unless every point of every source records the same settings, engine
commit, hardware, checkpoint ids and, per arm, the same server settings (the same fields the report
marks as MIXED). The merged manifest lists every source and run; each merged point keeps the sweep
and repeat it came from. Every source must have measured every cell (arm x concurrency) that is
merged (choose them with --arms / --concurrency): an arm measured by one command only would be
compared with the others as if their spreads were alike. Sweeps from before checkpoint ids were recorded cannot show they measured
the same weights (a path is not a build): merging them needs --assume-same-checkpoints REASON, and
the reason is written into the manifest and the report.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from adaspec.bench.point_conditions import mixed_settings, setting
from adaspec.bench.runner import BenchError, write_json_atomic

_REPEAT = re.compile(r"_r(\d+)\.json$")


def _read_source(src: Path) -> tuple[dict, list[tuple[Path, dict]]]:
    if not (src / "manifest.json").is_file():
        raise BenchError(f"{src} has no manifest.json: not a sweep's --out directory, or its conditions are unknown")
    try:
        manifest = json.loads((src / "manifest.json").read_text())
    except json.JSONDecodeError as e:
        raise BenchError(f"{src / 'manifest.json'} is not valid JSON ({e})") from None
    points = []
    for p in sorted((src / "points").glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a torn file of an interrupted run: not a point
        if not d.get("complete"):
            continue
        if not d.get("conditions"):
            raise BenchError(f"{p} records no conditions (written before points recorded them): its settings "
                             "cannot be checked against the other sources'")
        if not _REPEAT.search(p.name):
            raise BenchError(f"{p}: not a sweep point's file name (ARM_c<C>_r<R>.json or ARM_phases_r<R>.json)")
        points.append((p, d))
    if not points:
        raise BenchError(f"{src / 'points'} holds no complete point")
    return manifest, points


def _cell(path: Path) -> str:
    return _REPEAT.sub("", path.name)  # ARM_c<C> or ARM_phases


def _select(read: list, arms: list[str] | None, concurrency: list[int] | None) -> list:
    """Keeps the chosen arms and concurrencies, and checks that every source measured every cell that
    is kept: a cell from one source only would be compared, in the verdicts, against cells of other
    commands as if the spreads were comparable."""
    def keep(d):
        return ((arms is None or d.get("arm") in arms)
                and (concurrency is None or d.get("concurrency") is None or int(d["concurrency"]) in concurrency))

    measured_arms = {d.get("arm") for _, _, pts in read for _, d in pts}
    measured_c = {int(d["concurrency"]) for _, _, pts in read for _, d in pts if d.get("concurrency") is not None}
    if arms is not None and (unknown := [a for a in arms if a not in measured_arms]):
        raise BenchError(f"--arms: no source measured {', '.join(unknown)} (they measured {', '.join(sorted(measured_arms))})")
    if concurrency is not None and (unknown := [c for c in concurrency if c not in measured_c]):
        raise BenchError(f"--concurrency: no source measured {unknown} (they measured {sorted(measured_c) or 'load phases only'})")
    read = [(src, m, [(p, d) for p, d in pts if keep(d)]) for src, m, pts in read]
    for src, _, pts in read:
        if not pts:
            raise BenchError(f"{src} holds no point of the chosen arms / concurrencies")
    cells = [{_cell(p) for p, _ in pts} for _, _, pts in read]
    label = {_cell(p): f"{d.get('arm')} " + (f"C={d['concurrency']}" if d.get("concurrency") is not None else "(load phases)")
             for _, _, pts in read for p, d in pts}
    common = set.intersection(*cells)
    if any(c != common for c in cells):
        only = "; ".join(f"{src}: {', '.join(label[x] for x in sorted(c - common))}"
                         for (src, _, _), c in zip(read, cells) if c - common)
        arms_common = sorted({d["arm"] for _, _, pts in read for p, d in pts if _cell(p) in common})
        raise BenchError(f"the sources did not all measure the same cells (arm x concurrency); only in some: {only}. "
                         "Merge the cells every source measured: --arms / --concurrency "
                         f"(arms with a common cell: {', '.join(arms_common) or 'none'})")
    return read


def merge_sweeps(sources: list[str | Path], out: str | Path, assume_same_checkpoints: str | None = None,
                 arms: list[str] | None = None, concurrency: list[int] | None = None, report: bool = True) -> dict:
    """Writes OUT/points (renumbered repeats), OUT/manifest.json, OUT/logs/<i>-<source>/ and the
    report; returns {"manifest", "out", "points", "report"?}. Refuses (BenchError, naming the
    setting or the cells) sources whose conditions differ or that did not measure the same cells;
    `arms` / `concurrency` keep only those."""
    srcs = [Path(s) for s in sources]
    out = Path(out)
    if len(srcs) < 2:
        raise BenchError("merge needs at least two sweep directories")
    if len({s.resolve() for s in srcs}) < len(srcs):
        raise BenchError("a sweep directory is given twice: its repeats would count twice")
    if out.exists() and any(out.iterdir()):
        raise BenchError(f"{out} exists and is not empty: merge writes a new directory")
    read = _select([(s, *_read_source(s)) for s in srcs], arms, concurrency)
    every = [d for _, _, pts in read for _, d in pts]

    mixed = mixed_settings(every)
    if mixed:
        raise BenchError("the sources were not measured under the same conditions; differing: " + ", ".join(mixed)
                         + " (`adaspec bench report` on each source lists the values)")
    ids = {json.dumps(setting(d["conditions"], "checkpoints"), sort_keys=True) for d in every}
    known = [json.loads(i) for i in ids if json.loads(i) and any(json.loads(i).values())]
    if not known:
        if not assume_same_checkpoints:
            raise BenchError("the sources record no checkpoint sha256 (sweeps from before they were recorded), so "
                             "nothing shows they measured the same weights: the model path alone does not (every "
                             "build on the GPU machine is written to the same path). If you know they did, say how: "
                             "--assume-same-checkpoints 'REASON' (written into the manifest and the report)")
    elif assume_same_checkpoints:
        raise BenchError("--assume-same-checkpoints is for sources without checkpoint ids; these record them "
                         "(and they match), so leave it out")

    (out / "points").mkdir(parents=True)
    next_repeat: dict[str, int] = {}
    merged_from, runs, written = [], [], 0
    for i, (src, manifest, pts) in enumerate(read):
        for path, d in pts:
            group = _cell(path)
            r = next_repeat.get(group, 0)
            next_repeat[group] = r + 1
            d = {**d, "repeat": r, "merged_from": {"sweep": str(src), "repeat": d.get("repeat")}}
            write_json_atomic(str(out / "points" / f"{group}_r{r}.json"), d)
            written += 1
        if (src / "logs").is_dir():
            shutil.copytree(src / "logs", out / "logs" / f"{i}-{src.name}")
        merged_from.append({"sweep": str(src), "start_time": manifest.get("start_time"),
                            "end_time": manifest.get("end_time"), "points": len(pts)})
        runs += [{**run, "sweep": str(src)} for run in manifest.get("runs", [])]

    first = read[0][1]
    kept = {d["arm"] for _, _, pts in read for _, d in pts}
    arm_records = {}
    for _, manifest, _ in read:
        for a in manifest.get("arms", []):
            if a["name"] in kept:
                arm_records.setdefault(a["name"], a)
    merged = {k: v for k, v in first.items() if k not in ("arms", "concurrency", "repeats", "start_time", "end_time", "runs")}
    merged.update({
        "arms": list(arm_records.values()),
        "concurrency": sorted({int(d["concurrency"]) for _, _, pts in read for _, d in pts if d.get("concurrency") is not None}),
        "repeats": max(next_repeat.values()),
        "start_time": min((m.get("start_time") for _, m, _ in read if m.get("start_time")), default=None),
        "end_time": max((m.get("end_time") for _, m, _ in read if m.get("end_time")), default=None),
        "runs": runs,
        "merged_from": merged_from,
    })
    if assume_same_checkpoints:
        merged["checkpoints_assumed_same"] = assume_same_checkpoints
    write_json_atomic(str(out / "manifest.json"), merged)
    res = {"manifest": merged, "out": out, "points": written}
    if report:
        from adaspec.bench.report import write_report

        res["report"] = write_report(out)
    return res


def provenance_lines(manifest: dict | None) -> list[str]:
    """Markdown list items for a merged sweep's report: its sources and any assumption made."""
    m = manifest or {}
    if not m.get("merged_from"):
        return []
    lines = [f"- **merged from {len(m['merged_from'])} sweeps** (`adaspec bench merge`; repeats renumbered in "
             "source order, each point keeps its source in `merged_from`):"]
    lines += [f"  - `{s['sweep']}`: {s['points']} points, {s.get('start_time')} to {s.get('end_time')}"
              for s in m["merged_from"]]
    if m.get("checkpoints_assumed_same"):
        lines.append("- **checkpoints not recorded by the sources; assumed the same by whoever merged them:** "
                     f"{m['checkpoints_assumed_same']}")
    return lines
