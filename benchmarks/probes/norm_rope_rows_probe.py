"""What the compiled q/k-norm + RoPE + cache write (models/fused.qk_norm_rope_write_kv) costs per
call at each number of query rows, compiled three ways: as the engine compiles it (one
torch.compile with dynamic shapes, which dynamo specializes for 1 row apart from every other
count), compiled for each row count alone (static shapes), and not at all (eager ops).

Why: H100 run 57's profile of the speculative step (BENCHMARKS.md) found the verify graph's three
norm / RoPE / cache-write kernels a layer at 227 us for 28 layers and 8 rows, against the decode
graph's 124 us for one row; the q kernel alone 4.2 us a call against ~1.7 us. If the dynamic
kernel is the reason, compiling per captured size would save ~0.1 ms a verify step.

On CUDA each call is timed inside a CUDA graph of --calls calls (launch costs out, as in the
engine's graphs), bf16 as the engine runs; on the CPU (the smoke test) plain calls in float32.
The three versions must give the same q and cache within rounding (checked, not only timed).

    python3 benchmarks/probes/norm_rope_rows_probe.py [--rows 1,2,4,8,16,64,256] [--heads 16,8,128] [--calls 50]

Prints one row per row count (us per call: eager, dynamic, static, static / dynamic); writes
$OUT/norm_rope_rows_probe.json when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch._dynamo

from adaspec.models.fused import qk_norm_rope_write_kv


def inputs(T: int, Hq: int, Hkv: int, D: int, slots: int, dtype, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    angles = torch.rand(4096, D, device=dev, generator=g) * 6.2832
    q, k, v = (torch.randn(T, h, D, device=dev, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    storage = torch.zeros(2, slots, Hkv, D, device=dev, dtype=dtype)  # allocate_kv_caches' layout, one layer
    return dict(q=q, k=k, v=v, positions=torch.randint(0, 4096, (T,), device=dev, generator=g),
                cos=angles.cos(), sin=angles.sin(), qw=torch.randn(D, device=dev, generator=g).to(dtype),
                kw=torch.randn(D, device=dev, generator=g).to(dtype), storage=storage,
                slots=torch.randperm(slots, device=dev, generator=g)[:T])


def call(fn, x):
    s = x["storage"]
    return fn(x["q"], x["k"], x["v"], x["positions"], x["cos"], x["sin"], x["qw"], x["kw"], 1e-6, s[0], s[1], x["slots"])


def us_per_call(fn, x, calls: int) -> float:
    call(fn, x)  # compiles, if it will
    if x["q"].is_cuda:
        for _ in range(3):
            call(fn, x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                call(fn, x)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (10 * calls)
    t = time.perf_counter()
    for _ in range(calls):
        call(fn, x)
    return (time.perf_counter() - t) * 1e6 / calls


def agree(a, b, dtype) -> bool:
    """Within a few rounding steps of the larger magnitude (compiled code may skip a bf16 rounding)."""
    step = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -20
    return (a.float() - b.float()).abs().max().item() <= 4 * step * max(b.float().abs().max().item(), 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64,256", help="query rows per call (decode: requests; verify: requests x (k + 1))")
    ap.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head dim (Qwen3-0.6B's by default)")
    ap.add_argument("--slots", type=int, default=65536, help="cache slots of the layer written")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    Hq, Hkv, D = (int(h) for h in args.heads.split(","))
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if any(r < 1 for r in rows) or max(rows) > args.slots:
        raise SystemExit(f"--rows: each count must be in [1, --slots = {args.slots}], got {args.rows}")

    torch._dynamo.reset()
    for limit in ("cache_size_limit", "recompile_limit"):  # one compiled entry per row count, past the default 8
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 4 * len(rows) + 8)
    dynamic = torch.compile(qk_norm_rope_write_kv, dynamic=True, fullgraph=True)  # as cuda_compiled does
    results = []
    print(f"device={dev} dtype={dtype} heads q/kv/dim {Hq}/{Hkv}/{D}, {args.calls} calls a timing"
          + (" in one CUDA graph" if dev.type == "cuda" else ""))
    print(f"{'rows':>6} {'eager us':>10} {'dynamic us':>11} {'static us':>10} {'static/dyn':>11}")
    for T in rows:
        x = {name: inputs(T, Hq, Hkv, D, args.slots, dtype, dev, seed=T) for name in ("eager", "dynamic", "static")}
        # static: a fresh compile that may not turn dynamic on seeing a second size
        torch._dynamo.config.automatic_dynamic_shapes = False
        static = torch.compile(qk_norm_rope_write_kv, dynamic=False, fullgraph=True)
        times = {"eager": us_per_call(qk_norm_rope_write_kv, x["eager"], args.calls),
                 "dynamic": None, "static": us_per_call(static, x["static"], args.calls)}
        torch._dynamo.config.automatic_dynamic_shapes = True
        times["dynamic"] = us_per_call(dynamic, x["dynamic"], args.calls)
        # the same inputs (one seed) for all three: the same queries, the same cache after their calls
        q_eager = call(qk_norm_rope_write_kv, x["eager"])
        same = all(agree(call(f, x[n]), q_eager, dtype) and agree(x[n]["storage"], x["eager"]["storage"], dtype)
                   for n, f in (("dynamic", dynamic), ("static", static)))
        if not same:
            raise SystemExit(f"{T} rows: the compiled versions disagree with the eager ops beyond rounding")
        results.append({"rows": T, **{f"{n}_us": t for n, t in times.items()}})
        print(f"{T:>6} {times['eager']:>10.2f} {times['dynamic']:>11.2f} {times['static']:>10.2f} "
              f"{times['static'] / times['dynamic']:>11.3f}", flush=True)
    print(f"dynamo: {dict(torch._dynamo.utils.counters['stats'])}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "norm_rope_rows_probe.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                                   "torch": torch.__version__, "dtype": str(dtype), "heads": [Hq, Hkv, D],
                                   "calls": args.calls, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
