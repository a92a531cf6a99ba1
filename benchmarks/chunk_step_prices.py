"""What drafting beside prompt chunks really cost, against what the decode tables priced it at,
from an offline sweep's step trace (offline_sweep.py --step-trace) of an adaptive arm and a
baseline arm (no-spec) at one concurrency.

Until the first request of a point ends, both arms admit the same requests in the same steps, so
their step traces line up one to one: step i carries the same prompt tokens in both (the script
takes the longest such prefix). Over that prefix's steps in which the adaptive arm drafted beside
prompt chunks, it sums:

- the extra wall time: the adaptive arm's step walls minus the baseline's steps of the same index;
- the priced extra: what the arm's own cost tables say the drafting added to those steps, as the
  graphed pipelined step runs it (the decoding rows in their graphs, the chunks in their own
  forward): draft_ms(R) + verify(R rows, R + B tokens) - verify(R rows, R tokens), R the drafted
  rows and B the verified drafts of the trace, the verify priced padded as the graphs run it
  (the adaptive arm's query levels, every 1..k + 1, and the capture sizes of --max-num-seqs);
- the split: what the tables say it costs to run the decoding rows in a forward of their own
  beside the chunks' (as the graphed pipelined step does, drafting or not) instead of inside the
  chunks' forward (as the baseline does): verify(R rows, R tokens) + verify(P) - verify(R + P), P
  the step's prompt tokens. The separate mode's price leaves it out; the fused mode's rule
  (policy.mixed_step_terms) counts it, so "priced" plus "split" is what that rule prices the same
  drafting at;
- the extra tokens: the arm's emitted tokens minus the baseline's;

and prints the extra tokens per ms of extra wall beside the baseline's own rate in its decode-only
steps at the full concurrency (the rate those tokens would otherwise have been made at), and the
arm's own rate there (what the fused mode's margin values time at under measured step costs,
policy.mixed_step_terms).
BENCHMARKS.md, H100 run 60: on the Qwen3-8B shape at 256 requests the drafting cost 2-2.6x its
price there, and its tokens came at half the baseline's decode-only rate; the split accounts for
about half of the difference (39-45 ms of 78-103).

    python3 benchmarks/chunk_step_prices.py SWEEP.json[.xz] [--concurrency 256] [--baseline none]
        [--max-num-seqs 256] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replay_policy import padded_cost  # noqa: E402

from adaspec.bench.json_file import read_json  # noqa: E402
from adaspec.engine.cuda_graphs import capture_sizes  # noqa: E402
from adaspec.spec_decode.cost_model import CostModel  # noqa: E402
from adaspec.spec_decode.graphed_step import query_levels  # noqa: E402
from adaspec.spec_decode.policy import step_verify_ms  # noqa: E402


def aligned_prefix(arm_steps: list[dict], base_steps: list[dict]) -> int:
    """How many leading steps carry the same prompt tokens in both traces."""
    n = 0
    for a, b in zip(arm_steps, base_steps):
        if a["prompt_tokens"] != b["prompt_tokens"]:
            break
        n += 1
    return n


def drafting_extra_ms(cost, rows: int, verified: int) -> float:
    """The tables' price of drafting `verified` drafts for `rows` decoding rows, over the same rows'
    plain graphed step."""
    plain = float(np.ravel(step_verify_ms(cost, rows, rows))[0])
    drafted = float(np.ravel(step_verify_ms(cost, rows, rows + verified))[0])
    return float(cost.draft_ms(rows)) + drafted - plain


def split_ms(cost, rows: int, prompt_tokens: int) -> float:
    """The tables' price of the decoding rows' own forward (their graphed step, plain) beside the
    chunks' forward, over one forward that carries both."""
    own = float(np.ravel(step_verify_ms(cost, rows, rows))[0])
    apart = own + float(np.ravel(cost.verify_ms(prompt_tokens))[0])
    return apart - float(np.ravel(cost.verify_ms(rows + prompt_tokens))[0])


def decode_rate(steps: list[dict], concurrency: int) -> float | None:
    """Tokens per ms of the decode-only steps at the full concurrency, or None without any."""
    full = [s for s in steps if s["prompt_tokens"] == 0 and s["running"] == concurrency]
    wall = sum(s["wall_ms"] for s in full)
    return sum(s["generated_tokens"] for s in full) / wall if wall > 0 else None


def compare(cost, arm_steps: list[dict], base_steps: list[dict], concurrency: int) -> dict:
    """The sums of the module's docstring for one repeat of one arm."""
    n = aligned_prefix(arm_steps, base_steps)
    idx = [i for i in range(n) if arm_steps[i]["drafted_rows"] > 0 and arm_steps[i]["prompt_tokens"] > 0]
    extra_wall = sum(arm_steps[i]["wall_ms"] - base_steps[i]["wall_ms"] for i in idx)
    extra_tokens = sum(arm_steps[i]["generated_tokens"] - base_steps[i]["generated_tokens"] for i in idx)
    priced = sum(drafting_extra_ms(cost, arm_steps[i]["drafted_rows"], arm_steps[i]["verified_drafts"]) for i in idx)
    split = sum(split_ms(cost, arm_steps[i]["drafted_rows"], arm_steps[i]["prompt_tokens"]) for i in idx)
    return dict(aligned_steps=n, drafting_chunk_steps=len(idx), extra_wall_ms=extra_wall, priced_extra_ms=priced,
                split_ms=split,
                extra_tokens=extra_tokens, extra_tokens_per_ms=extra_tokens / extra_wall if extra_wall > 0 else None,
                baseline_decode_tokens_per_ms=decode_rate(base_steps, concurrency),
                arm_decode_tokens_per_ms=decode_rate(arm_steps, concurrency))


def _traces(sweep: dict, concurrency: int) -> dict[tuple[str, int], list[dict]]:
    fields = sweep.get("step_trace_fields")
    if not fields:
        raise SystemExit("the sweep has no step trace (run offline_sweep.py with --step-trace)")
    return {(r["arm"], r["repeat"]): [dict(zip(fields, s)) for s in r["step_trace"]]
            for r in sweep["rows"] if r["concurrency"] == concurrency and r.get("step_trace")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="an offline sweep's JSON (.json or .json.xz) with --step-trace")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--baseline", default="none", help="the arm whose steps the others are lined up with")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the graphs' capture sizes (the sweep's engines)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sweep = read_json(args.sweep)
    traces = _traces(sweep, args.concurrency)
    tables = sweep.get("cost_tables") or {}
    out = []
    for (arm, rep), steps in sorted(traces.items()):
        base = traces.get((args.baseline, rep))
        if arm not in tables or base is None:
            continue
        k = int(arm.rsplit(":", 1)[1])
        cost = padded_cost(CostModel.from_dict(tables[arm]), capture_sizes(args.max_num_seqs),
                           query_levels(k, every=True))
        row = dict(arm=arm, repeat=rep, concurrency=args.concurrency) | compare(cost, steps, base, args.concurrency)
        out.append(row)
        rate = row["extra_tokens_per_ms"]
        base_rate = row["baseline_decode_tokens_per_ms"]
        print(f"{arm} repeat {rep}, C={args.concurrency}: {row['drafting_chunk_steps']} drafting chunk steps in the "
              f"first {row['aligned_steps']} aligned with {args.baseline}: extra wall {row['extra_wall_ms']:.1f} ms, "
              f"priced {row['priced_extra_ms']:.1f} ms, split {row['split_ms']:.1f} ms; "
              f"{row['extra_tokens']} extra tokens"
              + (f" at {rate:.1f} tok/ms" if rate is not None else "")
              + (f" ({args.baseline}'s decode-only steps: {base_rate:.1f} tok/ms)" if base_rate is not None else "")
              + (f"; the arm's decode-only steps: {row['arm_decode_tokens_per_ms']:.1f} tok/ms"
                 if row["arm_decode_tokens_per_ms"] is not None else ""))
    if not out:
        print(f"no adaptive arm with cost tables and a {args.baseline} trace at concurrency {args.concurrency}")
    if args.json:
        args.json.write_text(json.dumps({"sweep": str(args.sweep), "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
