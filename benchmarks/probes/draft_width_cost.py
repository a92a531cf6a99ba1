"""Probe: what a draft of w slots costs against the full block, by requests, on a Qwen3 shape with a
stand-in drafter (synthetic method, random weights): the adaptive step's own draft timing
(spec_decode/profiler.py's `_dummy_steps`: the captured propose graph on CUDA, the eager propose
elsewhere), each (requests, width) timed `--repeats` times after a warm-up, the median kept.

Why: H100 run 70's cost tables priced a 2-slot draft of the Qwen3-8B shape at 107.5 ms for 256
requests against 5.1 ms for all 7 slots: the LM head was handed a strided view of the block, and
F.linear then read its whole weight once per request (fixed in 6ea9a99). A narrower draft must cost
at most what the full block costs; this prints the ratio, width by width.

    python3 benchmarks/probes/draft_width_cost.py [--shape qwen3-8b] [--requests 1,16,64,256] [--widths 2,4]
    python3 benchmarks/probes/draft_width_cost.py --device cpu --shape-overrides '{"num_hidden_layers": 2, ...}'

Writes $OUT/draft_width_cost.json (default OUT: ./out).
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec import LLM  # noqa: E402
from adaspec.spec_decode.profiler import _dummy_steps  # noqa: E402
from offline_sweep import shape_model_dir  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--shape-overrides", default=None, metavar="JSON")
    ap.add_argument("--k", type=int, default=7, help="the drafter's block and the full draft's width")
    ap.add_argument("--widths", default="2,4", help="narrower widths to time beside the full one")
    ap.add_argument("--requests", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    requests = [int(x) for x in args.requests.split(",")]
    widths = sorted({int(x) for x in args.widths.split(",")} | {args.k})
    if widths[0] < 1 or widths[-1] > args.k:
        raise SystemExit(f"--widths must lie in 1..k={args.k}, got {args.widths}")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cfg = {"method": "synthetic", "synthetic_acceptance": [0.8] * args.k, "num_speculative_tokens": args.k,
           "enable_adaptive_verification": True, "adaptive_draft_width": "budget",
           # the engine's startup tables are not what this probe reads: one run a shape is enough
           "profile_repeats": 1, "cost_model_cache_dir": str(out_dir / "cost_models")}
    llm = LLM(shape_model_dir(args.shape, args.shape_overrides), load_format="dummy", skip_tokenizer_init=True,
              device=device, max_num_seqs=max(requests), speculative_config=cfg)
    eng = llm.llm_engine
    draft = _dummy_steps(eng, eng.spec)[2]  # (requests, width) -> one draft, as the profiler times it
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    rows = []
    for n in requests:
        ms = {}
        for w in widths:
            draft(n, w)  # warm-up
            runs = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                draft(n, w)
                sync()
                runs.append((time.perf_counter() - t0) * 1e3)
            ms[w] = statistics.median(runs)
        rows.append({"requests": n, "ms": {str(w): v for w, v in ms.items()}})
        cells = [f"{w} slots {ms[w]:8.3f} ms ({ms[w] / ms[args.k]:.2f}x)" for w in widths]
        print(f"{n:4d} requests: " + ", ".join(cells), flush=True)
    (out_dir / "draft_width_cost.json").write_text(json.dumps(
        {"commit": os.environ.get("ADASPEC_COMMIT"), "device": str(eng.device), "shape": args.shape,
         "shape_overrides": args.shape_overrides, "k": args.k, "repeats": args.repeats, "rows": rows,
         "graphed": eng.spec.graphed is not None}, indent=1))


if __name__ == "__main__":
    main()
