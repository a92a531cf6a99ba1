"""GPU probe: how stable the adaptive policy's verify cost table is when its shapes are timed shape
after shape (the method before 88f7954) or in rounds over all the shapes (since), on one engine.
H200 run 29's adaptive:7 and adaptive-narrow:7 servers of one build logged verify tables that
differed by 0.07-0.28 ms (the narrow one's higher at every shape: an offset between the arms, which
this probe cannot see); this probe measures how much one engine's table moves between profiles.

The engine: the code-0.6b pair's target shape on random weights (load_format "dummy") with the
synthetic stand-in drafter at k = 7 (its cost is a 1-layer DSpark drafter's), adaptive verification,
CUDA graphs, --max-num-seqs 64. The verify table is profiled --profiles times by each method,
alternating in the order ABBA (so neither method is always the first of a pair), with --repeats
runs per shape; per shape the spread (max - min) over the profiles is
reported, and the rise from 16 to 128 tokens each profile found (from the first to the last
shape where the grid lacks them). Prints a table, writes
$OUT/cost_table_stability.json.

    python3 benchmarks/probes/cost_table_stability.py [--profiles 4] [--repeats 9]
    python3 benchmarks/probes/cost_table_stability.py --model tiny --max-num-seqs 4 --profiles 2 --repeats 2  # CPU smoke test
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
from adaspec.spec_decode.profiler import _dummy_steps  # noqa: E402
from qwen3_shapes import write_preset_shape  # noqa: E402

# run 29's held-out conditional acceptance at T = 1 (the stand-in drafter's curve: timing only)
CURVE = [0.76, 0.67, 0.63, 0.61, 0.59, 0.58, 0.58]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the code-0.6b preset's target shape on random weights")
    ap.add_argument("--preset", default="code-0.6b")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--profiles", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    spec = {"method": "synthetic", "synthetic_acceptance": CURVE, "num_speculative_tokens": 7,
            "enable_adaptive_verification": True, "cost_model_cache_dir": tempfile.mkdtemp(), "profile_repeats": 1}
    if args.model:
        llm = LLM(args.model, max_num_seqs=args.max_num_seqs, speculative_config=spec)
    else:
        shape = write_preset_shape(args.preset, args.vocab, tempfile.mkdtemp(prefix="adaspec-shape-"))
        llm = LLM(str(shape), load_format="dummy", skip_tokenizer_init=True,
                  max_num_seqs=args.max_num_seqs, speculative_config=spec)
    engine = llm.llm_engine
    decoder = engine.spec
    verify, _, _, ctx = _dummy_steps(engine, decoder)
    k = decoder.num_spec_tokens
    sizes = verify_grid(min(engine.config.max_num_batched_tokens, engine.config.max_num_seqs * (k + 1)))
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
    tables = {"shape after shape": [], "rounds": []}
    with torch.inference_mode():
        for i in range(args.profiles):
            for method in (("shape after shape", "rounds") if i % 2 == 0 else ("rounds", "shape after shape")):
                if method == "rounds":
                    ms = _time_table(verify, sizes, args.repeats, 1, time.perf_counter, sync, None).ms
                else:  # each shape's runs back to back (one shape per call)
                    ms = np.maximum.accumulate([
                        float(_time_table(verify, [n], args.repeats, 1, time.perf_counter, sync, None).ms[0])
                        for n in sizes])
                tables[method].append(ms.tolist())
    print(f"device {torch.cuda.get_device_name() if sync else 'cpu'}; verify table, {len(sizes)} shapes, "
          f"{args.repeats} runs each, {args.profiles} profiles per method, context {ctx}")
    print(f"{'tokens':>7} " + " ".join(f"{m + ' ms (min-max)':>32}" for m in tables))
    out = {"device": torch.cuda.get_device_name() if sync else "cpu", "sizes": sizes, "repeats": args.repeats,
           "profiles": args.profiles, "context_len": ctx, "tables": tables, "summary": {}}
    for i, n in enumerate(sizes):
        cells = []
        for m, ts in tables.items():
            col = [t[i] for t in ts]
            cells.append(f"{np.median(col):8.3f} ({min(col):.3f}-{max(col):.3f})")
        print(f"{n:>7} " + " ".join(f"{c:>32}" for c in cells))
    for m, ts in tables.items():
        a = np.array(ts)
        spread = (a.max(0) - a.min(0))
        i16, i128 = (sizes.index(16), sizes.index(128)) if 16 in sizes and 128 in sizes else (0, len(sizes) - 1)
        rise = (a[:, i128] - a[:, i16]).tolist()
        out["summary"][m] = {"max_spread_ms": float(spread.max()), "median_spread_ms": float(np.median(spread)),
                             "rise_from_tokens": sizes[i16], "rise_to_tokens": sizes[i128], "rise_ms": rise}
        print(f"{m}: spread over profiles max {spread.max():.3f} ms, median {np.median(spread):.3f} ms; "
              f"rise {sizes[i16]} -> {sizes[i128]} tokens: {', '.join('%.3f' % r for r in rise)} ms")
    dest = Path(os.environ.get("OUT", "."))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "cost_table_stability.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
