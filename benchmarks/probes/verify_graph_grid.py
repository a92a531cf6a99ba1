"""GPU probe: what each captured verify graph (B rows, Q query tokens a row) costs, against what the
adaptive policy's verify table prices it at.

The table (profiler.py) is indexed by tokens alone: verify(n) is timed as ceil(n / (k+1)) rows of
k + 1 tokens, and a served step of R rows verifying q - 1 drafts each is priced as verify(B*Q) of
the graph it runs (graphed_step.GraphPaddedCost), i.e. as B*Q / (k+1) rows of k + 1 tokens. A
step with fewer drafts a row has more rows per token than the table timed: whatever a row costs
on its own (its context's K/V read by attention, its sampling and acceptance) is then priced at
the table's row count. In H200 run 76's moving load the served decode-only drafting steps at
~50 rows took 1.5-1.8x their price, and the policy verified 4-5 drafts a request where fixed:3
made more tokens per second. This probe times every graph (B, Q) with B up to --max-num-seqs, in
rounds over the grid (as the profiler does), and prints, per B, the measured ms by Q beside the
table's price, and a least-squares fit ms = c0 + c_row * B + c_tok * B * Q over the graphs of
B >= 8.

The engine: the code-0.6b pair's target shape on random weights (load_format "dummy") with the
synthetic stand-in drafter at k = 7 (timing only), adaptive verification, CUDA graphs.
Writes $OUT/verify_graph_grid.json.

    python3 benchmarks/probes/verify_graph_grid.py [--max-num-seqs 128] [--repeats 9] [--context 256] [--distinct-kv]
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec import LLM  # noqa: E402
from adaspec.spec_decode.cost_model import _time_table, verify_grid  # noqa: E402
from adaspec.spec_decode.profiler import _dummy_context, _dummy_steps  # noqa: E402
from qwen3_shapes import write_preset_shape  # noqa: E402

# run 76's held-out conditional acceptance at T = 1 (the stand-in drafter's curve: timing only)
CURVE = [0.7938, 0.7183, 0.6757, 0.6519, 0.6320, 0.6210, 0.6107]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="code-0.6b")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--context", type=int, default=256, help="context length of every dummy row")
    ap.add_argument("--distinct-kv", action="store_true",
                    help="time the grid a second time with each row reading its own context blocks (the profiler "
                         "aliases every row to the same blocks, which can stay in the L2 cache; real requests read "
                         "theirs from memory)")
    args = ap.parse_args()
    spec = {"method": "synthetic", "synthetic_acceptance": CURVE, "num_speculative_tokens": 7,
            "enable_adaptive_verification": True, "cost_model_cache_dir": tempfile.mkdtemp(),
            "profile_repeats": 1, "profile_context_len": args.context}
    shape = write_preset_shape(args.preset, args.vocab, tempfile.mkdtemp(prefix="adaspec-shape-"))
    llm = LLM(str(shape), load_format="dummy", skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
              speculative_config=spec)
    engine, decoder = llm.llm_engine, llm.llm_engine.spec
    g = decoder.graphed
    if g is None or not g.verify_graphs:
        raise SystemExit("verify_graph_grid.py: this engine captured no verify graphs (CUDA graphs off?)")
    k = decoder.num_spec_tokens
    verify, _, _, _ = _dummy_steps(engine, decoder)
    ctx, table_blocks = _dummy_context(engine, decoder)  # what the profile's dummy requests read
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
    keys = sorted(key for key in g.verify_graphs if key[1] > 1)  # drafting steps verify q > 1 tokens a row

    distinct = torch.arange(args.max_num_seqs * len(table_blocks), dtype=torch.int32).view(args.max_num_seqs, -1)
    distinct = (distinct % engine.num_blocks).to(g.block_tables.device)

    def replay(i: int, own_blocks: bool = False) -> None:
        b, q = keys[i]
        if own_blocks:  # every row reads its own context, as real requests do (the profile aliases them)
            g._fill_dummy(b, table_blocks, ctx, q - 1)
            g.block_tables[:b, : len(table_blocks)] = distinct[:b]
            g.nq[:b].fill_(q)
            g.verify_graphs[keys[i]].replay()
        else:
            g.time_verify_graph(b, q, table_blocks, ctx)

    def time_grid(own_blocks: bool) -> dict:
        """(rows, q) -> median ms over the grid, timed in rounds (raw medians: no running max)."""
        runs = {i: [] for i in range(len(keys))}
        for i in range(len(keys)):
            replay(i, own_blocks)
        for _ in range(args.repeats):
            for i in range(len(keys)):
                if sync is not None:
                    sync()
                t0 = time.perf_counter()
                replay(i, own_blocks)
                if sync is not None:
                    sync()
                runs[i].append(1e3 * (time.perf_counter() - t0))
        return {keys[i]: float(np.median(r)) for i, r in runs.items()}

    with torch.inference_mode():
        sizes = verify_grid(min(engine.config.max_num_batched_tokens, engine.config.max_num_seqs * (k + 1)))
        table = _time_table(verify, sizes, args.repeats, 1, time.perf_counter, sync, None)
        grids = {"aliased": time_grid(False)}
        if args.distinct_kv:
            grids["distinct"] = time_grid(True)
    device = torch.cuda.get_device_name() if sync else "cpu"
    print(f"device {device}; k = {k}, context {ctx}, {args.repeats} runs a graph, in rounds")
    print("the table (tokens -> ms): " + ", ".join(f"{int(n)}: {m:.3f}" for n, m in zip(table.sizes, table.ms)))
    out = {"device": device, "k": k, "context_len": ctx, "repeats": args.repeats, "max_num_seqs": args.max_num_seqs,
           "table": table.to_dict()}
    for mode, measured in grids.items():
        print(f"every row's context: {'its own blocks' if mode == 'distinct' else 'the same blocks (as the profile)'}")
        out[mode] = report(measured, table)
    dest = Path(os.environ.get("OUT", "."))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "verify_graph_grid.json").write_text(json.dumps(out, indent=1))


def report(measured: dict, table) -> dict:
    """Print measured / priced ms by rows and level, and the fit; -> both as JSON."""
    keys = sorted(measured)
    levels = sorted({q for _, q in keys})
    print(f"{'B':>4} " + " ".join(f"{'Q=%d meas/price' % q:>18}" for q in levels))
    rows = []
    for b in sorted({b for b, _ in keys}):
        cells = []
        for q in levels:
            if (b, q) not in measured:
                cells.append(f"{'-':>18}")
                continue
            price = float(table.lookup(b * q))
            cells.append(f"{measured[(b, q)]:8.3f}/{price:<8.3f} ")
            rows.append({"rows": b, "q": q, "tokens": b * q, "measured_ms": measured[(b, q)], "priced_ms": price})
        print(f"{b:>4} " + " ".join(cells))
    fit_rows = [r for r in rows if r["rows"] >= 8]
    fit = None
    if len(fit_rows) >= 3:
        a = np.array([[1.0, r["rows"], r["tokens"]] for r in fit_rows])
        y = np.array([r["measured_ms"] for r in fit_rows])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        resid = y - a @ coef
        fit = {"c0_ms": float(coef[0]), "per_row_us": 1e3 * float(coef[1]), "per_token_us": 1e3 * float(coef[2]),
               "rms_residual_ms": float(np.sqrt(np.mean(resid ** 2))), "graphs": len(fit_rows)}
        print(f"fit over {len(fit_rows)} graphs of B >= 8: ms = {coef[0]:.3f} + {1e3 * coef[1]:.2f} us x B "
              f"+ {1e3 * coef[2]:.3f} us x B*Q (rms residual {fit['rms_residual_ms']:.3f} ms)")
    return {"graphs": rows, "fit": fit}

if __name__ == "__main__":
    main()
