"""Tensor-parallel decode benchmark (issue 14's goals): the engine's whole decode step at
batch 1 and batch 64 on the Qwen3-8B shape (dummy weights, bfloat16, CUDA graphs unless
--enforce-eager), at tensor_parallel_size 1 and 2, and the speedups against the goals
(batch 1: TP=2 >= 1.6x TP=1; batch 64: >= 1.7x).

Each size runs in its own engine, one after the other (the TP=2 engine's workers take
cuda:0 and cuda:1). Writes $OUT/tp_decode_bench.json (default ./out).
Usage on a 2-GPU host:   python3 benchmarks/tp_decode_bench.py
CPU smoke test (gloo):   python3 benchmarks/tp_decode_bench.py --shape tiny --device cpu --steps 3 --prompt-len 32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GOALS = {1: 1.6, 64: 1.7}  # batch -> required speedup of TP=2 over TP=1


def decode_steps_any(eng, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """decode_bench's timing (with its device-sync count on CUDA)."""
    from decode_bench import decode_steps

    return decode_steps(eng, batch, prompt_len, steps, vocab)


def run_size(model: str, tp: int, args, batches: list[int]) -> list[dict]:
    from adaspec.config import EngineConfig
    from adaspec.engine.llm_engine import LLMEngine

    max_len = args.prompt_len + args.steps + 64
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(
        model=model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype, device=args.device,
        max_num_seqs=max(batches), max_model_len=max_len, max_num_batched_tokens=8192,
        num_kv_blocks=max(batches) * (-(-max_len // 16)) + 8, enforce_eager=args.enforce_eager,
        tensor_parallel_size=tp, async_scheduling=args.async_scheduling == "on"))
    print(f"\nTP={tp}: engine start {time.perf_counter() - t0:.1f} s, graphs: {eng.runner.graphs is not None}",
          flush=True)
    vocab = eng.model_config.vocab_size
    out = []
    try:
        for b in batches:
            r = decode_steps_any(eng, b, args.prompt_len, args.steps, vocab)
            r.update(tp=tp, batch=b)
            out.append(r)
            print(f"  batch {b:>4}: {r['step_ms']:8.2f} ms/step (p90 {r['step_ms_p90']:.2f}), "
                  f"{r['syncs_per_step']} syncs", flush=True)
    finally:
        eng.shutdown()
        del eng  # the next size starts on a free GPU 0
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b", help="a benchmarks/qwen3_shapes.py shape, or an embedded model (tiny)")
    ap.add_argument("--sizes", default="1,2", help="tensor_parallel_size values to time")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--async-scheduling", choices=["on", "off"], default="on",
                    help="the same for every size, so that the sizes compare like with like (the engine's "
                         "default is on at TP = 1 and off above it)")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    batches = [int(x) for x in args.batches.split(",")]
    from qwen3_shapes import SHAPES, write_shape

    model = str(write_shape(args.shape, Path(tempfile.mkdtemp()))) if args.shape in SHAPES else args.shape
    rows = []
    for tp in (int(x) for x in args.sizes.split(",")):
        rows += run_size(model, tp, args, batches)
    by = {(r["tp"], r["batch"]): r["step_ms"] for r in rows}
    verdict = []
    print("\nspeedup of TP=2 over TP=1 (goal):")
    for b in batches:
        if (1, b) in by and (2, b) in by:
            s = by[(1, b)] / by[(2, b)]
            goal = GOALS.get(b)
            verdict.append({"batch": b, "speedup": s, "goal": goal, "met": goal is None or s >= goal})
            print(f"  batch {b:>4}: {s:.2f}x" + (f" (goal {goal}x: {'met' if s >= goal else 'NOT met'})" if goal else ""))
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_decode_bench.json").write_text(json.dumps(
        {"shape": args.shape, "device": args.device, "dtype": args.dtype, "enforce_eager": args.enforce_eager,
         "async_scheduling": args.async_scheduling,
         "prompt_len": args.prompt_len, "steps": args.steps, "rows": rows, "speedups": verdict}, indent=2))
    print(f"written: {out / 'tp_decode_bench.json'}")
    return 0


if __name__ == "__main__":  # spawn re-imports this module in the workers: nothing may run at import
    sys.exit(main())
