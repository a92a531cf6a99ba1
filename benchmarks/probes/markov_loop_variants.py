"""GPU probe: the drafter's Markov loop of k slots in one kernel a slot (models/markov_loop_triton.py)
against markov_triton's two or three kernels a slot, each replayed as a CUDA graph: the same
tokens and q, and what each costs at how many rows. It is what sets the drafter's switch-over,
markov_loop_triton.MAX_ROWS (the one-kernel loop reads every row's partials once per program, so
its cost grows with rows x chunks while the launches it saves do not).

For each vocabulary (--vocab), rows count (--rows) and greedy / sampled (T = 1, a quarter of the
rows greedy), with random base logits and Markov weights of rank 64 in bf16: checks that both
loops draft the same tokens (a sampled row may differ where its uniform lies within rounding of a
CDF boundary: the count is printed) and q within float rounding, then times each as a graph
replay (CUDA events, 300 replays, two rounds in alternating order). Prints a table and writes
$OUT/markov_loop_variants.json (or --out).

    python3 benchmarks/probes/markov_loop_variants.py [--vocab 16384,151936] [--rows 1,4,16,32,64,256] [--slots 7]
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaspec.engine.graph_capture import record_graph  # noqa: E402
from adaspec.models import markov_loop_triton as ml  # noqa: E402
from adaspec.models import markov_triton as mt  # noqa: E402
from spec_step_profile import time_replays  # noqa: E402  (CUDA-event ms per call)


def slots_loop(base, anchors, w1, w2, temps, tokens, q, u, lg):
    """markov_triton's slots one after another (what the drafter runs above MAX_ROWS)."""
    for j in range(base.shape[1]):
        mt.markov_slot(base[:, j], anchors if j == 0 else tokens[:, j - 1], w1, w2, temps, tokens[:, j],
                       lg if q is not None else None, q_out=None if q is None else q[:, j],
                       uniforms=None if q is None else u[j])


def one_kernel_loop(base, anchors, w1, w2, temps, tokens, q, u, lg):
    ml.markov_loop(base, anchors, w1, w2, temps, tokens, None, q_out=q, uniforms=u)


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    g, _ = record_graph(fn)
    return g.replay


def case(V, R, k, sampled, rank=64):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(V + R)
    base = (3 * torch.randn(R, k, V, device=dev, generator=g)).to(torch.bfloat16)
    w1 = (0.3 * torch.randn(V, rank, device=dev, generator=g)).to(torch.bfloat16)
    w2 = (0.3 * torch.randn(V, rank, device=dev, generator=g)).to(torch.bfloat16)
    anchors = torch.randint(0, V, (R,), device=dev, generator=g)
    temps = torch.ones(R, device=dev) if sampled else torch.zeros(R, device=dev)
    if sampled:
        temps[::4] = 0.0
    u = torch.rand(k, R, device=dev, generator=g) if sampled else None
    out = {}
    for name, fn in (("slots", slots_loop), ("loop", one_kernel_loop)):
        tokens = torch.empty(R, k, dtype=torch.long, device=dev)
        q = torch.empty(R, k, V, device=dev) if sampled else None
        lg = torch.empty(R, V, device=dev)
        replay = graphed(lambda: fn(base, anchors, w1, w2, temps, tokens, q, u, lg))
        replay()
        torch.cuda.synchronize()
        # the graph writes where it was captured, so out keeps its buffers as long as the graph:
        # rebinding the names in the next iteration freed them, and torch.cuda.graph's empty_cache
        # then unmapped them (H100 run 64's illegal memory access at 151,936 x 32 rows)
        out[name] = (replay, tokens.clone(), None if q is None else q.clone(), (tokens, q, lg))
    (_, t0, q0, _), (_, t1, q1, _) = out["slots"], out["loop"]
    rows_differ = int((t0 != t1).any(1).sum())
    same = (t0 == t1).all(1)
    q_err = float((q0[same] - q1[same]).abs().max()) if sampled and bool(same.any()) else 0.0
    times = {"slots": [], "loop": []}
    for order in (("slots", "loop"), ("loop", "slots")):
        for name in order:
            times[name].append(time_replays(out[name][0], n=300))
    return {"vocab": V, "rows": R, "slots": k, "sampled": sampled, "rows_differ": rows_differ, "q_max_abs_diff": q_err,
            "ms_slots": min(times["slots"]), "ms_loop": min(times["loop"]), "ms_slots_all": times["slots"],
            "ms_loop_all": times["loop"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="16384,151936")
    ap.add_argument("--rows", default="1,4,16,32,64,256")
    ap.add_argument("--slots", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'V':>7} {'R':>4} {'mode':>7} {'slots ms':>9} {'loop ms':>8} {'loop/slots':>10} {'rows differ':>11} {'q diff':>8}")
    for V in (int(x) for x in args.vocab.split(",")):
        for R in (int(x) for x in args.rows.split(",")):
            for sampled in (False, True):
                r = case(V, R, args.slots, sampled)
                rows.append(r)
                print(f"{V:7d} {R:4d} {'sampled' if sampled else 'greedy':>7} {r['ms_slots']:9.4f} {r['ms_loop']:8.4f} "
                      f"{r['ms_loop'] / r['ms_slots']:10.3f} {r['rows_differ']:11d} {r['q_max_abs_diff']:8.1e}", flush=True)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "markov_loop_variants.json")
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "drafter_loop_rows_default": ml.MAX_ROWS, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
