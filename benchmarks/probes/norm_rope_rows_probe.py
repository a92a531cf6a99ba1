"""What the compiled q/k-norm + RoPE + cache write (models/fused.qk_norm_rope_write_kv) costs per
call at each number of query rows, compiled three ways: as the engine compiles it (one
torch.compile with dynamic shapes, which dynamo specializes for 1 row apart from every other
count), compiled for each row count alone (static shapes), and not at all (eager ops). The
dynamic kernels take their size hints and tuned configs from the first call that compiles them,
and the engine captures its graphs largest first (up to thousands of rows), so the dynamic
version is compiled once per --dynamic-first row count. (In torch's inductor, a persistent
reduction over a 128-wide head, such as the q/k norms, gets candidate configs of 1, 8 and 32 rows
per program, filtered by the row hint, and the autotuner picks one at the kernel's first launch:
the largest graph's, where 32 rows a program may suit; 8 rows x 16 heads then make 4 programs.)

Why: H100 run 57's profile of the speculative step (BENCHMARKS.md) found the verify graph's three
norm / RoPE / cache-write kernels a layer at 227 us for 28 layers and 8 rows, against the decode
graph's 124 us for one row; the q kernel alone 4.2 us a call against ~1.7 us. If the dynamic
kernel tuned for thousands of rows is the reason, compiling it first at a small row count (or per
captured size) would save ~0.1 ms a verify step at one request. (Not run on a GPU before H100 run
58, which tested the idea in the engine instead: a second compilation for calls of at most 16 rows
came out with the same kernels and times, and was removed; one Triton kernel a layer,
models/qk_norm_rope_triton.py, took the 227 us to 61 us and is the engine's default since. This
probe times the compiled function, which the engine runs with ADASPEC_FUSED_KV_WRITE=1.)

On CUDA each call is timed inside a CUDA graph of --calls calls (launch costs out, as in the
engine's graphs), bf16 as the engine runs; on the CPU (the smoke test) plain calls in float32.
The three versions must give the same q and cache within rounding (checked, not only timed).

    python3 benchmarks/probes/norm_rope_rows_probe.py [--rows 1,2,4,8,16,64,256] [--dynamic-first 2,4096]
        [--heads 16,8,128] [--calls 50]

Prints one row per row count (us per call: eager, static, and each dynamic@N, first compiled at N
rows); writes $OUT/norm_rope_rows_probe.json when OUT is set.
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
    ap.add_argument("--dynamic-first", default="2,4096",
                    help="one dynamic compile per value, first called (so hinted and tuned) at that many rows: the "
                         "engine captures its graphs largest first")
    ap.add_argument("--heads", default="16,8,128", help="query heads, KV heads, head dim (Qwen3-0.6B's by default)")
    ap.add_argument("--slots", type=int, default=65536, help="cache slots of the layer written")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    firsts = [int(r) for r in args.dynamic_first.split(",")]
    Hq, Hkv, D = (int(h) for h in args.heads.split(","))
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if any(r < 1 for r in rows) or max(rows) > args.slots:
        raise SystemExit(f"--rows: each count must be in [1, --slots = {args.slots}], got {args.rows}")
    if any(r < 2 for r in firsts) or max(firsts) > args.slots:  # 1 row: dynamo specializes it apart
        raise SystemExit(f"--dynamic-first: each count must be in [2, --slots = {args.slots}], got {args.dynamic_first}")

    torch._dynamo.reset()
    for limit in ("cache_size_limit", "recompile_limit"):  # one compiled entry per row count, past the default 8
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 4 * len(rows) + 4 * len(firsts) + 8)
    dynamic = {}
    for first in firsts:  # as cuda_compiled compiles, each first called at its own row count
        dynamic[first] = torch.compile(qk_norm_rope_write_kv, dynamic=True, fullgraph=True)
        call(dynamic[first], inputs(first, Hq, Hkv, D, args.slots, dtype, dev, seed=0))
    names = ["eager", "static", *(f"dynamic@{f}" for f in firsts)]
    print(f"device={dev} dtype={dtype} heads q/kv/dim {Hq}/{Hkv}/{D}, {args.calls} calls a timing"
          + (" in one CUDA graph" if dev.type == "cuda" else "") + "; us per call (dynamic@N: first compiled at N rows)")
    print(f"{'rows':>6}" + "".join(f"{n:>14}" for n in names))
    results = []
    for T in rows:
        x = {n: inputs(T, Hq, Hkv, D, args.slots, dtype, dev, seed=T) for n in names}  # one seed: the same inputs
        # static: a fresh compile that may not turn dynamic on seeing a second size
        torch._dynamo.config.automatic_dynamic_shapes = False
        fns = {"eager": qk_norm_rope_write_kv, "static": torch.compile(qk_norm_rope_write_kv, dynamic=False, fullgraph=True)}
        times = {n: us_per_call(f, x[n], args.calls) for n, f in fns.items()}
        torch._dynamo.config.automatic_dynamic_shapes = True
        for first in firsts:
            fns[f"dynamic@{first}"] = dynamic[first]
            times[f"dynamic@{first}"] = us_per_call(dynamic[first], x[f"dynamic@{first}"], args.calls)
        # the same queries, and the same cache after their calls, as the eager ops
        q_eager = call(qk_norm_rope_write_kv, x["eager"])
        for n in names[1:]:
            if not (agree(call(fns[n], x[n]), q_eager, dtype) and agree(x[n]["storage"], x["eager"]["storage"], dtype)):
                raise SystemExit(f"{T} rows: {n} disagrees with the eager ops beyond rounding")
        results.append({"rows": T, "us_per_call": times})
        print(f"{T:>6}" + "".join(f"{times[n]:>14.2f}" for n in names), flush=True)
    print(f"dynamo: {dict(torch._dynamo.utils.counters['stats'])}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "norm_rope_rows_probe.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                                   "torch": torch.__version__, "dtype": str(dtype), "heads": [Hq, Hkv, D],
                                   "calls": args.calls, "dynamic_first": firsts, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
