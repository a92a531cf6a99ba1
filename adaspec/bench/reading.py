"""A short plain-language reading of a sweep, computed from its numbers (what `adaspec demo` prints
after the tables): which arm is on the Pareto edge at each concurrency, what a speculative step
cost relative to a target step, and what that implies.

Two sources for the step cost, both measured:
  * the sweep itself: a plain step delivers 1 token per request, a speculative step delivers the
    mean accepted length L, so one speculative step took L * v_none / v_spec target steps of time
    (v = per-user speed at the same concurrency);
  * the cost tables an adaptive server profiled at startup, cached on disk (adaspec/spec_decode/cost_model.py):
    a draft step for R requests against a target step for R requests, and the verify of R*(k+1) tokens.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from adaspec.bench.aggregate import Cell
from adaspec.bench.arms import SPECULATIVE_KINDS
from adaspec.bench.pareto import pareto_edge
from adaspec.bench.plot import X, cell_points

ACCEPTED = "spec_mean_accepted_length"
NEWEST_GPU_RUNS = 3  # the GPU runs of BENCHMARKS.md the reading names (the rest are counted)
# a BENCHMARKS.md section measured on a GPU: it says so, or names the card (H100 run 49, H200 run 41)
GPU_SECTION = re.compile(r"\bGPU\b|\bH[12]00\b")


def edge_arms(cells: dict[tuple[str, int], Cell]) -> dict[int, list[str]]:
    """Per concurrency: the arms no other arm at that concurrency matches or beats on both axes."""
    pts = cell_points(cells)
    return {c: [p.key[0] for p in pareto_edge([p for p in pts if p.key[1] == c])]
            for c in sorted({p.key[1] for p in pts})}


def step_cost_from_speeds(cells: dict[tuple[str, int], Cell], arm: str, c: int, base: str = "none") -> dict | None:
    """Time of one speculative step of `arm`, in plain (`base`) steps, at concurrency c; None if unmeasured."""
    s, b = cells.get((arm, c)), cells.get((base, c))
    if s is None or b is None:
        return None
    L, vs, vb = s.mean.get(ACCEPTED), s.mean.get(X), b.mean.get(X)
    if not L or not vs or not vb:
        return None
    return {"accepted": L, "v_spec": vs, "v_base": vb, "steps": L * vb / vs}


def default_cost_cache_dir() -> Path:
    # The directory adaspec.spec_decode.profiler caches to (same rule; not imported: that pulls in torch).
    return Path(os.environ.get("ADASPEC_CACHE_DIR", Path.home() / ".cache" / "adaspec")) / "cost_models"


def find_cost_model(model: str, k: int, drafter: str | None = None, cache_dir: Path | None = None,
                    max_num_seqs: int | None = None):
    """The newest cached cost model profiled for this target and k (and drafter and max_num_seqs when
    given: the server's settings): (path, CostModel)."""
    from adaspec.spec_decode.cost_model import CostModel

    d = cache_dir or default_cost_cache_dir()
    names = {model, str(Path(model).expanduser())}
    found = []
    for p in d.glob("cost_model_*.json") if d.is_dir() else []:
        try:
            doc = json.loads(p.read_text())
            key = doc["key"]
            if (key.get("model") in names and key.get("k") == k and (drafter is None or key.get("drafter") == drafter)
                    and (max_num_seqs is None or key.get("max_num_seqs") == max_num_seqs)):
                found.append((p.stat().st_mtime, p, CostModel.from_dict(doc["model"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a foreign or broken file is not evidence
    if not found:
        return None
    _, path, cm = max(found, key=lambda t: t[0])
    return path, cm


def _spec_arms(arms: list[str]) -> list[tuple[str, int]]:
    out = []
    for a in arms:
        kind, _, k = a.partition(":")
        if kind in SPECULATIVE_KINDS and k.isdigit():
            out.append((a, int(k)))
    return out


def reading_lines(cells: dict[tuple[str, int], Cell], arms: list[str], model: str | None,
                  drafter: str | None = None, cache_dir: Path | None = None,
                  benchmarks_md: Path | None = None, max_num_seqs: int | None = None) -> list[str]:
    lines = ["## Reading", ""]
    edges = edge_arms(cells)
    lines.append("- Pareto edge per concurrency (no other arm at that concurrency is at least as good on both axes): "
                 + "; ".join(f"C={c}: {', '.join(f'`{a}`' for a in e)}" for c, e in edges.items()) + ".")
    spec = _spec_arms(arms)
    concs = sorted({c for _, c in cells})
    for arm, k in spec:
        costs = [(c, step_cost_from_speeds(cells, arm, c)) for c in concs]
        costs = [(c, x) for c, x in costs if x]
        if not costs:
            continue
        if arm.startswith("adaptive"):
            # Its steps mix drafting and plain ones, so a per-step cost is not defined: speed only.
            parts = [f"C={c}: {x['v_spec'] / x['v_base']:.2f} x" for c, x in costs]
            lines.append(f"- `{arm}` (drafts up to {k} tokens, or skips drafting, step by step as its cost tables "
                         f"advise): per-user speed relative to `none`, {'; '.join(parts)}.")
            continue
        parts = [f"C={c}: {x['steps']:.2f} target steps for {x['accepted']:.2f} tokens" for c, x in costs]
        pays = [c for c, x in costs if x["accepted"] > x["steps"]]
        verdict = (f"it paid at C={', '.join(map(str, pays))}" if pays
                   else "it took longer than the tokens it delivered at every concurrency, so it lost")
        lines.append(f"- `{arm}`: one speculative step (draft {k}, verify {k + 1} tokens per request) took, in time "
                     f"of plain `none` steps, {'; '.join(parts)} (from per-user speed and mean accepted length); "
                     f"{verdict}.")
    # The profiled tables split a step into its draft and verify parts.
    for k in sorted({k for _, k in spec}):
        hit = find_cost_model(model, k, drafter, cache_dir, max_num_seqs) if model else None
        if hit is None:
            continue
        path, cm = hit
        rmax = int(cm.draft.sizes[-1])
        parts, even = [], {}
        for r in [c for c in concs if c <= rmax] or [rmax]:
            plain = cm.verify_ms(r)
            dr, ver = cm.draft_ms(r), cm.verify_ms(r * (k + 1))
            even[r] = (dr + ver) / plain
            parts.append(f"R={r}: draft {dr:.2f} ms = {dr / plain:.2f} x a target step ({plain:.2f} ms), "
                         f"verify of {r} x {k + 1} tokens {ver:.2f} ms; break-even at {even[r]:.2f} accepted "
                         "tokens per step")
        lines.append(f"- Profiled step costs for k={k} (the cost tables the server measured at startup, "
                     f"`{path}`): " + "; ".join(parts) + ".")
        # Fixed arms draft every step, so their accepted length is the one to hold against it.
        arm = next((a for a, kk in spec if kk == k and a.startswith("fixed")),
                   next(a for a, kk in spec if kk == k))
        got = {c: cells[(arm, c)].mean.get(ACCEPTED) for c in even if (arm, c) in cells}
        got = {c: L for c, L in got.items() if L}
        if got:
            above = [c for c, L in got.items() if L > even[c]]
            lines.append(f"  Measured mean accepted length of `{arm}`: "
                         + "; ".join(f"C={c}: {L:.2f}" for c, L in got.items())
                         + (f"; above the break-even at C={', '.join(map(str, above))}." if above else
                            "; below the break-even everywhere: here a speculative step costs more target steps "
                            "than it yields tokens."))
    bm = benchmarks_md if benchmarks_md is not None else Path(__file__).resolve().parents[2] / "BENCHMARKS.md"
    gpu = []
    if bm.is_file():  # its runs (second-level sections, newest first), not their subsections
        gpu = [ln[3:].strip() for ln in bm.read_text(encoding="utf-8").splitlines()
               if ln.startswith("## ") and GPU_SECTION.search(ln)]
    shown = "; ".join(f"\"{h}\"" for h in gpu[:NEWEST_GPU_RUNS])
    if len(gpu) > NEWEST_GPU_RUNS:
        shown += f"; and {len(gpu) - NEWEST_GPU_RUNS} earlier GPU runs"
    where = f"{bm.name}: {shown}" if gpu else "BENCHMARKS.md in the adaspec repository"
    lines.append(f"- Where speculation is meant to pay (a large target on a GPU, where a draft step costs a "
                 f"small fraction of a target step): {where}.")
    return lines + [""]


def max_num_seqs_of(server_args: list[str]) -> int | None:
    """--max-num-seqs from `adaspec serve` arguments (either spelling), None when not given."""
    for i, a in enumerate(server_args):
        v = a.split("=", 1)[1] if a.startswith("--max-num-seqs=") else (
            server_args[i + 1] if a == "--max-num-seqs" and i + 1 < len(server_args) else None)
        if v is not None and v.isdigit():
            return int(v)
    return None
