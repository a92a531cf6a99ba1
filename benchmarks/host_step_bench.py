"""The engine's host work per decode step, without a GPU: `LLMEngine.step()` of the plain engine
with the model forward replaced by a stub that returns ready logits, so what is timed is the
scheduler, the step's inputs, sampling's host side, the stop checks and detokenization, the
outputs, and the garbage collector. On the H200 this host work is most of the gap between a
decode step and its CUDA graph (benchmarks/decode_bench.py's "host share").

    python3 benchmarks/host_step_bench.py [--batch 256] [--steps 200] [--repeats 3]
        [--output-kind cumulative|final_only] [--gc as-is|freeze|off] [--temperature 0] [--out FILE]

--temperature T > 0 samples (the sampling batch, the keyed hash and the draw on the CPU, where the
hash runs eagerly: on CUDA it is one compiled kernel, so its share here overstates the GPU host's).

Prints the median over repeats of the mean step time, per phase (each phase timed by wrapping
the engine's own method), the collector's collections per step, the full collections during the
timed steps and their cost, and what one full collection costs afterwards: a process that
imported torch tracks ~300k objects, and a full collection walks them all unless they were
frozen (`adaspec serve` freezes what start-up built: adaspec/serve/server.py).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch

from adaspec import LLM, SamplingParams
from adaspec.engine.runner import ForwardResult
from adaspec.sampling_params import RequestOutputKind

PHASES = (("scheduler", "schedule"), ("engine", "_launch_plain_step"), ("engine", "_sample_on_device"),
          ("stop_checker", "append"), ("engine", "_output"))


def build(batch: int, output_kind: str, temperature: float = 0.0):
    eng = LLM("tiny", device="cpu", max_num_seqs=batch, max_model_len=2048).llm_engine
    kind = RequestOutputKind.CUMULATIVE if output_kind == "cumulative" else RequestOutputKind.FINAL_ONLY
    for i in range(batch):
        eng.add_request(str(i), list(range(5, 37)), SamplingParams(max_tokens=1900, temperature=temperature,
                                                                    ignore_eos=True, output_kind=kind))
    eng.step()  # the real prefill
    # a few columns: argmax over a whole vocabulary is device work on a GPU, not host work
    logits = torch.zeros(batch, 16)
    logits[:, 7] = 1.0
    hidden = torch.zeros(batch, 4)

    def stub(items, capture_layers=None, prev_tokens=None):
        n = len(items)
        return ForwardResult(logits[:n], hidden[:n], {}, np.arange(n + 1))

    eng.runner.execute = stub
    return eng


def timed(eng, acc: dict):
    for owner, name in PHASES:
        obj = eng if owner == "engine" else getattr(eng, owner)
        fn = getattr(obj, name)

        def wrapper(*a, _fn=fn, _key=f"{owner}.{name}", **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_key] = acc.get(_key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)


def one_repeat(args) -> dict:
    eng = build(args.batch, args.output_kind, args.temperature)
    acc: dict[str, float] = {}
    timed(eng, acc)
    for _ in range(5):
        eng.step()
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    gen_count, gen_time, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def cb(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gen_count[info["generation"]] += 1
            gen_time[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(cb)
    acc.clear()
    try:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        dt = (time.perf_counter() - t0) / args.steps
        gc.callbacks.remove(cb)
        t1 = time.perf_counter()
        gc.collect()  # what one full collection costs in this state (after the timed steps)
        full_ms = (time.perf_counter() - t1) * 1e3
    finally:
        if cb in gc.callbacks:
            gc.callbacks.remove(cb)
        gc.enable()
        gc.unfreeze()
    return dict(step_ms=dt * 1e3, phases_ms={k: v / args.steps * 1e3 for k, v in acc.items()},
                gc_collections_per_step=sum(gen_count) / args.steps,
                gc_ms_per_step_by_generation=[t / args.steps * 1e3 for t in gen_time], gc_collections=gen_count,
                full_collection_ms=full_ms, tracked_objects=len(gc.get_objects()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-kind", choices=("cumulative", "final_only"), default="cumulative",
                    help="cumulative: an output per request per step, as the server asks for")
    ap.add_argument("--gc", choices=("as-is", "freeze", "off"), default="as-is",
                    help="freeze: gc.freeze() after start-up, as `adaspec serve` does")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = [one_repeat(args) for _ in range(args.repeats)]
    med = statistics.median(r["step_ms"] for r in runs)
    print(f"batch {args.batch}, T={args.temperature:g}, {args.output_kind} outputs, gc {args.gc}: "
          f"host step {med:.3f} ms "
          f"(runs {', '.join(format(r['step_ms'], '.3f') for r in runs)}), "
          f"{statistics.median(r['gc_collections_per_step'] for r in runs):.2f} collections per step; full "
          f"collections in the timed steps {[r['gc_collections'][2] for r in runs]} costing "
          f"{[round(r['gc_ms_per_step_by_generation'][2], 3) for r in runs]} ms per step; one full collection "
          f"afterwards {statistics.median(r['full_collection_ms'] for r in runs):.1f} ms")
    for k in runs[0]["phases_ms"]:
        print(f"  {k:22s} {statistics.median(r['phases_ms'][k] for r in runs):.3f} ms")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(args=vars(args), torch=torch.__version__, runs=runs, median_step_ms=med), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
