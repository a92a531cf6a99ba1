"""Print Markdown tables (mean ± std over repeats) from an offline_sweep.py JSON; with --png PATH
also plot the frontier: output throughput against median per-user speed, one line per arm, each
point a concurrency (error bars: ± one standard deviation over the repeats). A sweep over several
output-length conditions (`--random-range-ratio 0,0.5`) gets a section, and a PNG (`NAME_rr0.5.png`),
per condition.

After the tables: the share of each point's wall time spent in steps that carry a prefill chunk
(where a point records its step kinds; H200 run 38: 80-88% for the speculative arms at 256 requests,
where those steps cost ~14 ms against ~5.7 for a decode step), the tokens per ms of the decode-only
steps that began with the batch full (offline_sweep's step_kinds decode_full_batch: the arms at the
same rows a step, where all decode-only steps mix full batches with the waves' tails), and the
verdict per concurrency that `adaspec bench report` gives a server sweep (bench/report.verdict_lines:
the arms dominated beyond the repeat spreads, and each arm's distance to the Pareto edge). Where the
sweep traced its steps (offline_sweep.py --step-trace), two more tables: the share of decode-only
steps that drafted and their mean wall (H100 run 62: with measured step costs, a point at one request
ran 44-53% of its decode-only steps plain, at 2.1 ms a drafting step against the default arm's 1.5).

    python3 benchmarks/summarize_sweep.py SWEEP.json [--png frontier.png]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaspec.bench.json_file import read_json  # noqa: E402


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from adaspec.figures import save_png

    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        pts = []
        for c in sorted({r["concurrency"] for r in rows if r["arm"] == arm}):
            sel = [r for r in rows if r["arm"] == arm and r["concurrency"] == c and r.get("median_user_speed")]
            if not sel:
                continue
            xs, ys = [r["output_throughput"] for r in sel], [r["median_user_speed"] for r in sel]
            sd = (lambda v: statistics.stdev(v) if len(v) > 1 else 0.0)  # noqa: E731
            pts.append((c, statistics.mean(xs), statistics.mean(ys), sd(xs), sd(ys)))
        line = ax.errorbar([p[1] for p in pts], [p[2] for p in pts], xerr=[p[3] for p in pts],
                           yerr=[p[4] for p in pts], marker="o", capsize=3, label=arm)
        for c, x, y, *_ in pts:
            ax.annotate(f"C={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                        color=line[0].get_color())
    a = doc.get("args", {})
    label = doc.get("synthetic_acceptance")
    ax.set_xscale("log")
    ax.set_xlabel("output throughput (tok/s)")
    ax.set_ylabel("median per-user speed (tok/s)")
    rr = a.get("random_range_ratio")
    spread = f" ± {rr:.0%}" if isinstance(rr, (int, float)) and rr else ""
    ax.set_title(f"T={a.get('temperature')}, {a.get('output_len')}{spread} output tokens, {repeats_note(doc)}"
                 + (f"\n{label}" if label else ""), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def repeats_note(doc: dict) -> str:
    """"3 repeats", or for a sweep stopped in time ("partial") or with uneven cells, how many each
    point has: "partial run: 1-2 of 3 repeats per point"."""
    rows, asked = doc["rows"], doc.get("args", {}).get("repeats")
    counts = {}
    for r in rows:
        counts[(r["arm"], r["concurrency"])] = counts.get((r["arm"], r["concurrency"]), 0) + 1
    lo, hi = min(counts.values(), default=0), max(counts.values(), default=0)
    if lo == hi == asked and not doc.get("partial"):
        return f"{asked} repeats"
    span = str(lo) if lo == hi else f"{lo}-{hi}"
    of = f" of {asked}" if asked else ""
    return f"{'partial run: ' if doc.get('partial') else ''}{span}{of} repeats per point"


def prefill_share(row: dict) -> float | None:
    """The share of a point's wall time in steps that ran prompt tokens (offline_sweep's step_kinds)."""
    kinds, wall = row.get("step_kinds"), row.get("duration")
    if not kinds or not wall:
        return None
    p = kinds.get("prefill") or {}
    return p.get("steps", 0) * p.get("ms_per_step", 0.0) / (1e3 * wall)


def full_batch_rate(row: dict) -> float | None:
    """Tokens per ms of the point's decode-only steps that began with max_num_seqs requests running
    (step_kinds decode_full_batch, sweeps since 2026-12-07); None without such steps."""
    full = (row.get("step_kinds") or {}).get("decode_full_batch") or {}
    return full.get("tokens_per_ms")


def decode_steps(row: dict) -> tuple[float, float | None] | None:
    """(share of the point's decode-only steps that drafted, their mean wall in ms, None if none
    drafted), from its step trace; None without one. Decode-only: no prompt tokens, some tokens
    emitted (the steps whose kind the draft-or-not choice decides)."""
    trace, fields = row.get("step_trace"), row.get("step_trace_fields")
    if not trace or not fields:
        return None
    wall, prompt, gen, drafted = (fields.index(k) for k in ("wall_ms", "prompt_tokens", "generated_tokens",
                                                             "drafted_rows"))
    decode = [s for s in trace if s[prompt] == 0 and s[gen] > 0]
    if not decode:
        return None
    drafting = [s[wall] for s in decode if s[drafted] > 0]
    return len(drafting) / len(decode), (statistics.mean(drafting) if drafting else None)


def plain_and_chunk_costs(row: dict) -> tuple[float | None, float | None] | None:
    """(mean wall in ms of the point's decode-only steps that did not draft, wall in ms per 1,000
    prompt tokens over its steps with a prompt chunk), from its step trace; None without one, and
    None for a kind it has no step of. Set beside no-spec's, they split a speculative arm's gap.
    Under async scheduling a step call waits for the step launched before it, so these are step
    calls' walls, not one step's GPU: a plain step right after a chunk step carries the chunk's
    wait, and a speculative arm, whose requests finish at different steps, runs more and smaller
    chunk steps than no-spec for the same prompt tokens (steady_plain_ms is the cleaner price of
    a plain step)."""
    trace, fields = row.get("step_trace"), row.get("step_trace_fields")
    if not trace or not fields:
        return None
    wall, prompt, gen, drafted = (fields.index(k) for k in ("wall_ms", "prompt_tokens", "generated_tokens",
                                                             "drafted_rows"))
    plain = [s[wall] for s in trace if s[prompt] == 0 and s[gen] > 0 and s[drafted] == 0]
    chunks = [s for s in trace if s[prompt] > 0]
    prompt_tokens = sum(s[prompt] for s in chunks)
    return (statistics.mean(plain) if plain else None,
            1e3 * sum(s[wall] for s in chunks) / prompt_tokens if prompt_tokens else None)


def steady_plain_ms(row: dict) -> float | None:
    """Median wall in ms of the point's steady plain steps: decode-only steps that did not draft,
    with every one of the point's requests running, between two such steps. Such a call waits for
    a step like itself, so this is one plain step's price. Read this way, H100 run 63's Qwen3-8B
    shape at 256 requests showed the speculative arms' plain steps 1.5% dearer than no-spec's
    (12.00 against 11.82 ms): the drafter's context over each step's tokens, ~1.3% of the target's
    FLOPs there; the mean over every plain step had shown no difference. None without a trace or
    without such a step."""
    trace, fields = row.get("step_trace"), row.get("step_trace_fields")
    if not trace or not fields:
        return None
    wall, prompt, gen, drafted, running = (fields.index(k) for k in (
        "wall_ms", "prompt_tokens", "generated_tokens", "drafted_rows", "running"))

    def plain(s):
        return s[prompt] == 0 and s[gen] > 0 and s[drafted] == 0 and s[running] == row["concurrency"]

    steady = [trace[i][wall] for i in range(1, len(trace) - 1)
              if plain(trace[i - 1]) and plain(trace[i]) and plain(trace[i + 1])]
    return statistics.median(steady) if steady else None


def chunk_steps(row: dict) -> tuple[float | None, int, float | None] | None:
    """(ms of the first wave's steps, steps with a prompt chunk, mean prompt tokens per such step)
    from the point's step trace; None without one. The first wave: the steps before the first
    decode-only one, timed by the calls that wait for them (under async scheduling a call waits
    for the step launched before it), None if the trace has no decode-only step. Until a request
    ends, every arm admits the same requests in the same steps, so the first wave carries the same
    prompt tokens in each arm and its time compares them step for step (H100 run 63's 8B shape:
    +1.8% with speculation); a speculative arm then runs more, smaller chunk steps, its requests
    finishing at different steps."""
    trace, fields = row.get("step_trace"), row.get("step_trace_fields")
    if not trace or not fields:
        return None
    wall, prompt, gen = (fields.index(k) for k in ("wall_ms", "prompt_tokens", "generated_tokens"))
    first_decode = next((i for i, s in enumerate(trace) if s[prompt] == 0 and s[gen] > 0), None)
    first_wave = sum(s[wall] for s in trace[1:first_decode + 1]) if first_decode else None
    chunks = [s[prompt] for s in trace if s[prompt] > 0]
    return first_wave, len(chunks), (statistics.mean(chunks) if chunks else None)


# what main tables from a step trace: (the function of a point, (row key, title, format) per value)
TRACE_TABLES = [
    (decode_steps, [("decode_drafted_share", "share of the decode-only steps that drafted (step trace)", "{:.2f}"),
                    ("decode_drafting_ms", "ms per decode-only step that drafted (step trace)", "{:.2f}")]),
    (plain_and_chunk_costs, [
        ("decode_plain_ms", "ms per decode-only step that did not draft (step trace)", "{:.2f}"),
        ("chunk_ms_per_k_prompt", "ms of steps with a prompt chunk per 1,000 prompt tokens (step trace)", "{:.2f}")]),
    (steady_plain_ms, [("steady_plain_ms", "ms per steady plain step: median, all requests running, between two "
                        "(step trace)", "{:.2f}")]),
    (chunk_steps, [
        ("first_wave_ms", "ms of the first wave's steps, before the first decode-only step (step trace)", "{:.1f}"),
        ("chunk_steps", "steps with a prompt chunk (step trace)", "{:.1f}"),
        ("prompt_per_chunk_step", "prompt tokens per step with a prompt chunk (step trace)", "{:.0f}")]),
]


def frontier_cells(rows: list[dict]) -> dict:
    """(arm, concurrency) -> bench.aggregate.Cell of the offline points, with the keys the server
    report's verdict reads (per-user speed median as X, output throughput as Y)."""
    from adaspec.bench.aggregate import Cell, mean_std
    from adaspec.bench.plot import X, Y

    cells = {}
    for arm, c in dict.fromkeys((r["arm"], r["concurrency"]) for r in rows):
        sel = [r for r in rows if r["arm"] == arm and r["concurrency"] == c]
        (xm, xs), (ym, ys) = (mean_std([r.get(k) for r in sel]) for k in ("median_user_speed", "output_throughput"))
        cells[(arm, c)] = Cell(arm, c, n=len(sel), mean={X: xm, Y: ym}, std={X: xs, Y: ys})
    return cells


def main(path: str, png: str | None = None) -> None:
    doc = read_json(path)
    # a sweep over several output-length conditions (offline_sweep --random-range-ratio 0,0.5): each
    # is a frontier of its own, tabled and judged apart (rows before 2026-12-07 name no ratio)
    ratios = list(dict.fromkeys(r.get("random_range_ratio") for r in doc["rows"]))
    if len(ratios) <= 1:
        return report(doc, png)
    for ratio in ratios:
        sub = {**doc, "args": {**doc.get("args", {}), "random_range_ratio": ratio},
               "rows": [r for r in doc["rows"] if r.get("random_range_ratio") == ratio]}
        print(f"\n## output lengths with range ratio {ratio:g}")
        report(sub, png and str(Path(png).with_name(f"{Path(png).stem}_rr{ratio:g}{Path(png).suffix}")))


def report(doc: dict, png: str | None = None) -> None:
    """The tables and the verdict of one frontier (one output-length condition)."""
    if png:
        plot(doc, png)
    rows = doc["rows"]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})

    def cell(arm, c, key, fmt="{:.0f}"):
        xs = [r[key] for r in rows if r["arm"] == arm and r["concurrency"] == c and r.get(key) is not None]
        if not xs:
            return "–"
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return (fmt + " ± " + fmt).format(statistics.mean(xs), sd)

    tables = [("output_throughput", "output tok/s", "{:.0f}"),
              ("median_user_speed", "per-user tok/s (median over requests)", "{:.1f}"),
              ("mean_accepted_length", "mean accepted length (bonus included)", "{:.2f}")]
    for r in rows:
        r["prefill_share"] = prefill_share(r)
    if any(r["prefill_share"] is not None for r in rows):
        tables.append(("prefill_share", "share of the point's wall time in steps with a prefill chunk", "{:.2f}"))
    for r in rows:
        r["full_batch_rate"] = full_batch_rate(r)
    if any(r["full_batch_rate"] is not None for r in rows):
        tables.append(("full_batch_rate", "tokens per ms of the decode-only steps that began with the batch full",
                       "{:.1f}"))
    if any(r.get("preemptions") for r in rows):  # recorded since 2026-12-07; a table only where some happened
        tables.append(("preemptions", "requests preempted (the KV cache was full; their recompute is in the wall)",
                       "{:.1f}"))
    fields = doc.get("step_trace_fields")
    for fn, columns in TRACE_TABLES:  # each from the points' step traces, where they have them
        for r in rows:
            d = fn({**r, "step_trace_fields": fields})
            d = (None,) * len(columns) if d is None else d if isinstance(d, tuple) else (d,)
            r.update(zip((key for key, _, _ in columns), d))
        if any(r[key] is not None for r in rows for key, _, _ in columns):
            tables += columns
    print(f"\n{repeats_note(doc)}; ± is one standard deviation over a point's repeats (0 with one)")
    for key, title, fmt in tables:
        print(f"\n{title}\n")
        print("| C | " + " | ".join(arms) + " |")
        print("|---" * (len(arms) + 1) + "|")
        for c in concs:
            print(f"| {c} | " + " | ".join(cell(a, c, key, fmt) for a in arms) + " |")
    from adaspec.bench.report import verdict_lines

    print("\nverdict per concurrency (dominated: worse on both axes beyond the repeat spreads)\n")
    for line in verdict_lines(frontier_cells(rows), arms):
        print(line)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    main(args.sweep, args.png)
