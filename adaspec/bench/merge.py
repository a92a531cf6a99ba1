"""`adaspec bench merge`: one report from the repeats of several sweeps measured under the same
conditions, e.g. two commands on one GPU machine that each ran 2 repeats of the same schedule.

Why: the spread within one command understates the spread between commands (H200 run 32: fixed:3's
whole-run throughput moved 1.5% between two commands on one build, beyond either command's spread),
so a verdict wants the repeats of several commands. A merge is only as honest as the match of its
sources, so it is refused unless every point of every source records the same settings, engine
commit, hardware, checkpoint ids and, per arm, the same server settings (the same fields the report
marks as MIXED). Every source must have measured every cell (arm x concurrency) that is merged
(choose them with --arms / --concurrency): an arm measured by one command only would be compared
with the others as if their spreads were alike. A source that is itself a merge, or a measurement
found in two sources (a copied folder), is refused: its repeats would count twice. The merged
manifest lists every source and run; each merged point keeps the sweep and repeat it came from.
Weights the points cannot vouch for (sweeps from before checkpoint ids were recorded, a drafter the
sweep could not fingerprint, servers at a --base-url, which the sweep cannot see into) need
--assume-same-checkpoints REASON, and the reason is written into the manifest and the report.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from pathlib import Path

from adaspec.bench.conditions import DIRTY
from adaspec.bench.point_conditions import mixed_settings, setting
from adaspec.bench.runner import BenchError, write_json_atomic

_REPEAT = re.compile(r"_r(\d+)\.json$")


def _cell(d: dict) -> tuple[str, int | None]:
    """A point's cell: its arm and concurrency (None: a moving load's schedule)."""
    return d.get("arm"), None if d.get("concurrency") is None else int(d["concurrency"])


def _label(cell: tuple[str, int | None]) -> str:
    return f"{cell[0]} " + ("(load phases)" if cell[1] is None else f"C={cell[1]}")


def _read_source(src: Path) -> tuple[dict, list[tuple[Path, dict]]]:
    """The manifest and the complete points, in cell order and then by repeat (numerically)."""
    if not (src / "manifest.json").is_file():
        raise BenchError(f"{src} has no manifest.json: not a sweep's --out directory, or its conditions are unknown")
    try:
        manifest = json.loads((src / "manifest.json").read_text())
    except json.JSONDecodeError as e:
        raise BenchError(f"{src / 'manifest.json'} is not valid JSON ({e})") from None
    if manifest.get("merged_from"):
        raise BenchError(f"{src} is itself a merge (of {', '.join(s['sweep'] for s in manifest['merged_from'])}): "
                         "merge the original sweeps instead, so that no repeat counts twice")
    points = []
    for p in (src / "points").glob("*.json"):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a torn file of an interrupted run: not a point
        if not d.get("complete"):
            continue
        if not d.get("conditions"):
            raise BenchError(f"{p} records no conditions (written before points recorded them): its settings "
                             "cannot be checked against the other sources'")
        m = _REPEAT.search(p.name)
        if not m:
            raise BenchError(f"{p}: not a sweep point's file name (ARM_c<C>_r<R>.json or ARM_phases_r<R>.json)")
        points.append((str(_cell(d)), int(m.group(1)), p, d))
    if not points:
        raise BenchError(f"{src / 'points'} holds no complete point")
    return manifest, [(p, d) for _, _, p, d in sorted(points, key=lambda x: x[:2])]


def _select(read: list, arms: list[str] | None, concurrency: list[int] | None) -> list:
    """Keeps the chosen arms and concurrencies, and checks that every source measured every cell kept."""
    measured_arms = {d.get("arm") for _, _, pts in read for _, d in pts}
    measured_c = {c for _, _, pts in read for _, d in pts if (c := _cell(d)[1]) is not None}
    if arms is not None and (unknown := [a for a in arms if a not in measured_arms]):
        raise BenchError(f"--arms: no source measured {', '.join(unknown)} (they measured {', '.join(sorted(measured_arms))})")
    if concurrency is not None and (unknown := [c for c in concurrency if c not in measured_c]):
        raise BenchError(f"--concurrency: no source measured {unknown} (they measured {sorted(measured_c) or 'load phases only'})")

    def keep(d):
        arm, c = _cell(d)
        return (arms is None or arm in arms) and (concurrency is None or c is None or c in concurrency)

    read = [(src, m, [(p, d) for p, d in pts if keep(d)]) for src, m, pts in read]
    for src, _, pts in read:
        if not pts:
            raise BenchError(f"{src} holds no point of the chosen arms / concurrencies")
    cells = [{_cell(d) for _, d in pts} for _, _, pts in read]
    common = set.intersection(*cells)
    if any(c != common for c in cells):
        only = "; ".join(f"{src}: {', '.join(_label(x) for x in sorted(c - common, key=str))}"
                         for (src, _, _), c in zip(read, cells) if c - common)
        raise BenchError(f"the sources did not all measure the same cells (arm x concurrency); only in some: {only}. "
                         "Merge the cells every source measured: --arms / --concurrency "
                         f"(arms with a common cell: {', '.join(sorted({a for a, _ in common})) or 'none'})")
    return read


def _refuse_repeated_measurements(read: list) -> None:
    """Two sources holding the same measurement (a copied folder) would count its repeats twice."""
    seen: dict[str, Path] = {}
    for _, _, pts in read:
        for p, d in pts:
            key = hashlib.sha256(json.dumps({k: v for k, v in d.items() if k != "repeat"}, sort_keys=True,
                                            default=str).encode()).hexdigest()
            if key in seen:
                raise BenchError(f"{seen[key]} and {p} hold the same measurement: one source is a copy of another "
                                 "(its repeats would count twice)")
            seen[key] = p


def _unverified_weights(points: list[dict]) -> list[str]:
    """What the points' checkpoint ids do not vouch for (mixed ids are refused before this)."""
    ids = setting(points[0]["conditions"], "checkpoints") or {}
    missing = []
    if not ids.get("model_sha256"):
        missing.append("the model's (no checkpoint sha256 recorded: a sweep from before they were recorded, or not "
                       "a local directory)")
    if not ids.get("drafter_sha256") and any(_arm(d).get("kind") != "none" for d in points):
        missing.append("the drafter's (no sha256 recorded for it)")
    external = sorted({d["arm"] for d in points if _arm(d).get("base_url")})
    if external:
        missing.append(f"those of the servers at a --base-url ({', '.join(external)}): the sweep cannot see what they serve")
    return missing


def _arm(d: dict) -> dict:
    return d["conditions"].get("arm") or {}


def merge_sweeps(sources: list[str | Path], out: str | Path, assume_same_checkpoints: str | None = None,
                 arms: list[str] | None = None, concurrency: list[int] | None = None, report: bool = True,
                 assume_same_code: str | None = None) -> dict:
    """Writes OUT/points (renumbered repeats), OUT/manifest.json, OUT/logs/<i>-<source>/ and the
    report; returns {"manifest", "out", "points", "report"?}. Refuses (BenchError, naming what)
    sources whose conditions or cells differ, repeated measurements, and unverified weights or
    engine code (a commit with uncommitted changes) without an assumption; `arms` / `concurrency`
    keep only those. Nothing is left in OUT when refused."""
    srcs = [Path(s) for s in sources]
    out = Path(out)
    if len(srcs) < 2:
        raise BenchError("merge needs at least two sweep directories")
    if len({s.resolve() for s in srcs}) < len(srcs):
        raise BenchError("a sweep directory is given twice: its repeats would count twice")
    if out.exists() and not out.is_dir():
        raise BenchError(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise BenchError(f"{out} exists and is not empty: merge writes a new directory")
    read = _select([(s, *_read_source(s)) for s in srcs], arms, concurrency)
    _refuse_repeated_measurements(read)
    every = [d for _, _, pts in read for _, d in pts]
    mixed = mixed_settings(every)
    if mixed:
        raise BenchError("the sources were not measured under the same conditions; differing: " + ", ".join(mixed)
                         + " (`adaspec bench report` on each source lists the values)")
    unverified = _unverified_weights(every)
    if unverified and not assume_same_checkpoints:
        raise BenchError("nothing shows that the sources measured the same weights for "
                         + "; ".join(unverified) + ". A path alone does not (every build on the GPU machine is "
                         "written to the same path). If you know they did, say how: --assume-same-checkpoints "
                         "'REASON' (written into the manifest and the report)")
    if assume_same_checkpoints and not unverified:
        raise BenchError("--assume-same-checkpoints is for weights the points cannot vouch for; these record "
                         "matching checkpoint ids for everything they measured, so leave it out")
    dirty = sorted({str(setting(d["conditions"], "engine_commit")) for d in every
                    if str(setting(d["conditions"], "engine_commit")).endswith(DIRTY)})
    if dirty and not assume_same_code:
        raise BenchError(f"the engine commit {dirty[0]} had uncommitted changes, which may differ between the "
                         "sources: nothing shows they ran the same code. If you know they did, say how: "
                         "--assume-same-code 'REASON' (written into the manifest and the report)")
    if assume_same_code and not dirty:
        raise BenchError("--assume-same-code is for a commit with uncommitted changes; these points record a clean "
                         "commit, so leave it out")

    # built beside OUT and renamed into place at the end: a refusal or crash leaves no half merge
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.merging-", dir=out.parent))
    try:
        merged = _write(read, tmp, assume_same_checkpoints, assume_same_code)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"manifest": merged, "out": out, "points": len(every)}
    if report:
        from adaspec.bench.report import write_report

        res["report"] = write_report(out)
    return res


def _write(read: list, out: Path, assume_same_checkpoints: str | None, assume_same_code: str | None = None) -> dict:
    (out / "points").mkdir()
    next_repeat: dict[str, int] = {}
    merged_from, runs = [], []
    for i, (src, manifest, pts) in enumerate(read):
        for path, d in pts:
            stem = _REPEAT.sub("", path.name)  # ARM_c<C> or ARM_phases: one per cell within a sweep
            r = next_repeat.get(stem, 0)
            next_repeat[stem] = r + 1
            d = {**d, "repeat": r, "merged_from": {"sweep": str(src), "repeat": d.get("repeat")}}
            write_json_atomic(str(out / "points" / f"{stem}_r{r}.json"), d)
        if (src / "logs").is_dir():
            shutil.copytree(src / "logs", out / "logs" / f"{i}-{src.name}")
        merged_from.append({"sweep": str(src), "start_time": manifest.get("start_time"),
                            "end_time": manifest.get("end_time"), "points": len(pts)})
        runs += [{**run, "sweep": str(src)} for run in manifest.get("runs", [])]

    kept_arms = {d["arm"] for _, _, pts in read for _, d in pts}
    kept_c = {c for _, _, pts in read for _, d in pts if (c := _cell(d)[1]) is not None}
    arm_records = {}
    for _, manifest, _ in read:
        for a in manifest.get("arms", []):
            if a["name"] in kept_arms:
                arm_records.setdefault(a["name"], a)
    first = read[0][1]
    merged = {k: v for k, v in first.items() if k not in ("arms", "concurrency", "repeats", "start_time", "end_time", "runs")}
    merged.update({
        "arms": list(arm_records.values()),
        # a moving load's points have no concurrency: keep what its sources recorded (the phases' caps)
        "concurrency": sorted(kept_c) if kept_c else sorted({c for _, m, _ in read for c in m.get("concurrency", [])}),
        "repeats": max(next_repeat.values()),
        "start_time": min((m.get("start_time") for _, m, _ in read if m.get("start_time")), default=None),
        "end_time": max((m.get("end_time") for _, m, _ in read if m.get("end_time")), default=None),
        "runs": runs,
        "merged_from": merged_from,
    })
    if assume_same_checkpoints:
        merged["checkpoints_assumed_same"] = assume_same_checkpoints
    if assume_same_code:
        merged["code_assumed_same"] = assume_same_code
    write_json_atomic(str(out / "manifest.json"), merged)
    return merged


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
        lines.append("- **weights not vouched for by checkpoint ids; assumed the same by whoever merged them:** "
                     f"{m['checkpoints_assumed_same']}")
    if m.get("code_assumed_same"):
        lines.append("- **engine code with uncommitted changes; assumed the same by whoever merged them:** "
                     f"{m['code_assumed_same']}")
    return lines
