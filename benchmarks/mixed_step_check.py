"""What the fused mode's rule decides for a step that carries prompt chunks beside decoding rows
(policy.mixed_step_drafts, `"adaptive_verification_mixed_steps": "fused"`), under the cost tables a
sweep profiled and a pair's held-out acceptance: for R decoding rows beside P prompt tokens, does it
draft, and by what margin.

The rule drafts iff the drafts' expected extra tokens S(B*) beat r_ref x (t_draft - t_plain): the
extra time priced by the tables, valued at r_ref, the best decode-only rate the tables offer. Both
sides come from the tables alone (GPU time, no host), so where the real decode-only steps make far
fewer tokens per ms than the tables promise, r_ref overvalues the time and the rule keeps chunk
steps plain that would pay to draft: compare the table's `ref` with the sweep's measured rates
(offline_sweep.py --step-trace). With linear tables, verify(n) = a + b n and a draft of d ms,
the rule drafts iff S / T > (a + d) / (b T) + B / T (T decoding rows, B* = B slots), which no S <= B
meets: beside chunks that run as a forward of their own it drafts only where the tables' steps
make verification cheaper than linear (tests/bench/test_mixed_step_check.py). The last column: the
per-step overhead (adaptive_verification_step_overhead_ms, or "measured") from which the rule
drafts, since an overhead lowers the decode-only rate the extra time is valued at, and the
decode-only rate below which it drafts (under measured step costs the rule values the time at the
rate the engine measured: compare chunk_step_prices.py's arm rates). Every request is taken to decode with the same survivals (the
curve's running products), as replay_policy.py's curve mode does.

    python3 benchmarks/mixed_step_check.py SWEEP.json[.xz] --pair pair.json [--arm adaptive-fused:7]
        [--requests 64,256] [--prompt-tokens 256,1024,2048,3072] [--max-num-seqs 256] [--json OUT.json]
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
from adaspec.spec_decode.policy import mixed_step_drafts, mixed_step_terms  # noqa: E402
from adaspec.spec_decode.step_overhead import OverheadCost, StepOverhead  # noqa: E402


def decide(cost, survivals: np.ndarray, requests: int, prompt_tokens: int) -> dict:
    """One decision of the graphed pipelined step (prompt chunks as a forward of their own), with
    the terms the rule weighs (policy.mixed_step_terms)."""
    t = mixed_step_terms(np.tile(survivals, (requests, 1)), requests, requests, prompt_tokens, requests, cost, True)
    extra = t.t_draft - t.t_plain
    return dict(requests=requests, prompt_tokens=prompt_tokens, drafts=t.drafts, budget=t.budget, gain=t.gain,
                ref_tokens_per_ms=t.ref, t_plain_ms=t.t_plain, t_draft_ms=t.t_draft,
                ref_times_extra=t.ref * extra,
                # the decode-only rate below which the rule drafts (what drafting adds per ms of its
                # priced extra time): compare a sweep's measured rates (chunk_step_prices.py), which
                # the rule uses under measured step costs
                drafts_below_tokens_per_ms=t.gain / extra if t.budget > 0 and extra > 0 else None)


def break_even_overhead(cost, survivals: np.ndarray, requests: int, prompt_tokens: int, limit: float = 100.0) -> float | None:
    """The least per-step overhead (ms added to every step's price, as
    adaptive_verification_step_overhead_ms adds it) at which the rule drafts beside these chunks:
    an overhead lowers the decode-only rate the extra time is valued at, not the extra time (the
    two forwards of a drafting step count it once). None: not below `limit` ms."""
    grid = np.tile(survivals, (requests, 1))

    def drafts(o: float) -> bool:
        priced = OverheadCost(cost, StepOverhead(o))
        return mixed_step_drafts(grid, requests, requests, prompt_tokens, requests, priced, True)[0]

    if drafts(0.0):
        return 0.0
    if not drafts(limit):
        return None
    lo, hi = 0.0, limit
    while hi - lo > 0.01:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if drafts(mid) else (mid, hi)
    return hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="an offline sweep's JSON (.json or .json.xz) with cost_tables")
    ap.add_argument("--pair", type=Path, required=True, help="the build's pair.json (held-out acceptance per T)")
    ap.add_argument("--arm", default=None, help="whose cost tables (default: the first adaptive arm that has some)")
    ap.add_argument("--requests", default="64,256")
    ap.add_argument("--prompt-tokens", default="256,1024,2048,3072")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the graphs' capture sizes (the sweep's engines)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    sweep, pair = read_json(args.sweep), read_json(args.pair)
    tables = sweep.get("cost_tables") or {}
    if not tables:
        ap.error(f"{args.sweep} has no cost_tables (an offline sweep with an adaptive arm writes them)")
    arm = args.arm or next(iter(tables))
    if arm not in tables:
        ap.error(f"no cost tables for arm {arm!r} in {args.sweep}; it has {', '.join(tables)}")
    k = int(arm.rsplit(":", 1)[1])
    cost = padded_cost(CostModel.from_dict(tables[arm]), capture_sizes(args.max_num_seqs), query_levels(k))
    rows = []
    print(f"cost tables of {arm} in {args.sweep}; held-out acceptance of {args.pair}")
    print("drafts iff gain > ref x (t_draft - t_plain); ref: the tables' best decode-only rate")
    for t_key, held in sorted(pair.get("heldout", {}).items()):
        if not t_key.startswith("T="):
            continue
        survivals = np.cumprod(np.clip(np.asarray(held["cond_acceptance"][:k], dtype=np.float64), 0.0, 1.0))
        for r in map(int, args.requests.split(",")):
            for p in map(int, args.prompt_tokens.split(",")):
                d = decide(cost, survivals, r, p) | {"temperature": t_key,
                                                     "break_even_overhead_ms": break_even_overhead(cost, survivals, r, p)}
                rows.append(d)
                print(f"{t_key} R={r:4d} P={p:5d}: drafts={str(d['drafts']):5s} B*={d['budget']:5d} "
                      f"gain={d['gain']:7.0f}  ref={d['ref_tokens_per_ms']:6.1f} tok/ms  t_plain={d['t_plain_ms']:6.2f} "
                      f"t_draft={d['t_draft_ms']:6.2f} ms  ref x extra={d['ref_times_extra']:7.0f}  drafts from an overhead of "
                      + ("> 100 ms" if d["break_even_overhead_ms"] is None else f"{d['break_even_overhead_ms']:.2f} ms")
                      + ("" if d["drafts_below_tokens_per_ms"] is None
                         else f", or below a decode-only rate of {d['drafts_below_tokens_per_ms']:.1f} tok/ms"))
    if args.json:
        args.json.write_text(json.dumps({"sweep": str(args.sweep), "pair": str(args.pair), "arm": arm, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
