"""GPU probe: the one-kernel q/k norm + RoPE + cache write (models/qk_norm_rope_triton.py) by heads
per program, at row counts from one decode row to a large prefill chunk, on a Qwen3 layer's heads.

Why: H200 run 76's profile of a 256-request step (the code-0.6b pair) spent 0.84 ms a step, 12% of
its kernel time, in this kernel: 46.6 calls of ~18 us each, where each call moves well under 2 MB.
With one program per (row, head) a 2,000-row chunk launches ~48,000 programs of 256 bytes each.
This times each heads-per-program choice (1 is the kernel before the grouping) inside a CUDA graph,
compares what every choice writes with one head per program (the norm's sum in another order can
move a bf16 value by a step: the largest difference is reported), and the bytes a call moves per us.

    python3 benchmarks/probes/qk_kernel_bench.py [--rows 1,8,64,256,1024,2048,4096] [--heads 16,8]
        [--head-dim 128] [--iters 200]
Writes $OUT/qk_kernel_bench.json (or ./qk_kernel_bench.json) and prints a table. CUDA only.
"""
import argparse
import json
import os
from pathlib import Path

import torch

from adaspec.engine.graph_capture import record_graph


def case(T: int, Hq: int, Hkv: int, D: int, dtype=torch.bfloat16, P: int = 4096):
    g = torch.Generator(device="cuda").manual_seed(T)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, device="cuda", generator=g).to(dtype)
    q, k, v = (x.view(T, -1, D) for x in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    angles = torch.rand(P, D // 2, device="cuda", generator=g) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    weights = [(torch.rand(D, device="cuda", generator=g) + 0.5).to(dtype) for _ in range(2)]
    positions = torch.randint(0, P, (T,), device="cuda", generator=g)
    S = 2 * T + 16
    slots = torch.randperm(S, device="cuda", generator=g)[:T]
    caches = torch.zeros(2, S, Hkv, D, device="cuda", dtype=dtype)
    return (q, k, v, positions, cos, sin, *weights, 1e-6), caches, slots


def time_us(fn, iters: int, per_graph: int = 20) -> float:
    """us per call of fn, replayed in a CUDA graph of per_graph calls, as the engine's graphed steps
    run the kernel: timed from Python, a call measures its launch (~70 us a call on H100 run 77's
    host, the same at every row count), not the kernel."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph, _ = record_graph(lambda: [fn() for _ in range(per_graph)])
    replays = max(1, iters // per_graph)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * per_graph)


def main() -> None:
    from adaspec.models.qk_norm_rope_triton import heads_per_program, launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64,256,1024,2048,4096")
    ap.add_argument("--heads", default="16,8", help="query heads, key/value heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("qk_kernel_bench.py times CUDA kernels: no CUDA device here")
    Hq, Hkv = (int(x) for x in args.heads.split(","))
    D = args.head_dim
    rows = [int(x) for x in args.rows.split(",")]
    choices = [1, 2, 4, 8, 16]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": [Hq, Hkv], "head_dim": D,
           "dtype": "bfloat16", "iters": args.iters, "rows": []}
    print(f"{out['device']}: Hq={Hq} Hkv={Hkv} D={D} bf16, us per call in a CUDA graph ({args.iters} calls); "
          "auto = the launch's choice")
    print(f"{'rows':>6} " + " ".join(f"{'hb=' + str(c):>9}" for c in choices) + f" {'auto':>9} {'GB/s auto':>10} {'equal':>6}")
    for T in rows:
        a, caches, slots = case(T, Hq, Hkv, D)
        ref_caches = caches.clone()
        ref_q = launch(*a, ref_caches[0], ref_caches[1], slots, heads_per_prog=1)
        row = {"rows": T, "auto_heads_per_program": heads_per_program(T, max(Hq, Hkv)), "us": {}, "equal": True}
        for c in choices:
            got = caches.clone()
            q = launch(*a, got[0], got[1], slots, heads_per_prog=c)
            # a norm's sum in another order can move a bf16 value by one step: count, do not demand, bit-equality
            row["equal"] &= bool(torch.equal(q, ref_q) and torch.equal(got, ref_caches))
            row.setdefault("max_abs_diff", 0.0)
            row["max_abs_diff"] = max(row["max_abs_diff"], float((q.float() - ref_q.float()).abs().max()),
                                      float((got.float() - ref_caches.float()).abs().max()))
            row["us"][str(c)] = round(time_us(lambda: launch(*a, caches[0], caches[1], slots, heads_per_prog=c),
                                              args.iters), 2)
        row["us"]["auto"] = round(time_us(lambda: launch(*a, caches[0], caches[1], slots), args.iters), 2)
        # bytes a call must move: q, k, v read; q written; k and v written to the cache (cos/sin aside)
        row["bytes"] = T * D * 2 * ((Hq + 2 * Hkv) + Hq + 2 * Hkv)
        row["gb_per_s_auto"] = round(row["bytes"] / row["us"]["auto"] / 1e3, 1)
        out["rows"].append(row)
        print(f"{T:>6} " + " ".join(f"{row['us'][str(c)]:>9.2f}" for c in choices)
              + f" {row['us']['auto']:>9.2f} {row['gb_per_s_auto']:>10.1f} {str(row['equal']):>6}")
    dest = Path(os.environ.get("OUT", ".")) / "qk_kernel_bench.json"
    dest.write_text(json.dumps(out, indent=1))
    print(f"written: {dest}")


if __name__ == "__main__":
    main()
