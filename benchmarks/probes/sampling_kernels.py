"""GPU probe: the sampler's Triton kernels (adaspec/sample/triton_sampling.py) against the torch
ops they replace, on random logits: are they the same function, and what does each cost?

History: H200 run 35's version of this probe timed the torch sampler's parts (141 us a call at 256
rows, the inverse-CDF cumsum 78 us of it; a torch.compile'd sampler drew other tokens and failed
at 256 rows), and run 38's step profile found the cumsum 5% of the adaptive step's kernel time.

For N rows (1, 256, and 2,048: 256 requests verifying 8 tokens each) of a --vocab logits block at
T = 1 (a quarter of the rows greedy): checks first that the kernels' probabilities match
processed_probs (max abs difference) and how many draws equal the torch inverse CDF's over the
same probabilities (a draw may differ only within float rounding of a CDF boundary), then times
each variant as a CUDA graph replay (CUDA events, 200 replays): processed_probs, the draw, the
plain decode sampler, and the drafter's k sequential slots (probabilities and a draw per slot,
what the propose graph runs at T > 0), torch against Triton; the plain decode sampler
(probs.sample_tokens: one kernel, an argmax pass alone for a greedy row) also against the three
kernels it replaced (probabilities, draw, argmax), with a quarter of the rows greedy and with all.
Prints a table and writes $OUT/sampling_kernels.json.

    python3 benchmarks/probes/sampling_kernels.py [--rows 1,256,2048] [--vocab 16384] [--slots 7]
    python3 benchmarks/probes/sampling_kernels.py --tune 4096x8,8192x16,16384x16,16384x32  # chunk x warps

--tune times the fused draw (probabilities and draw, one kernel) at each rows count for each chunk
width and warp count given (the kernels' _MAX_BLOCK and _NUM_WARPS), checking that every setting
draws the same tokens, and writes $OUT/sampling_kernels_tune.json instead.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaspec.engine.graph_capture import record_graph  # noqa: E402
from adaspec.engine.graphed_sampling import sample_decode_rows  # noqa: E402
from adaspec.sample import random as keyed  # noqa: E402
from adaspec.sample import kernels  # noqa: E402
from adaspec.sample.probs import processed_probs, sample_from_logits  # noqa: E402
from adaspec.sample.random import SAMPLE, keyed_uniforms, sample_categorical  # noqa: E402
from spec_step_profile import time_replays  # noqa: E402  (CUDA-event ms per call)


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call that compiles its kernels): its replay."""
    fn()
    torch.cuda.synchronize()
    g, _ = record_graph(fn)  # the collector paused (engine/graph_capture.py says why)
    return g.replay


def tune(args, out_dir):
    from adaspec.sample import triton_sampling as ts

    dev, V = torch.device("cuda"), args.vocab
    settings = [tuple(int(x) for x in s.split("x")) for s in args.tune.split(",")]
    result = []
    for n in (int(x) for x in args.rows.split(",")):
        g = torch.Generator(device=dev).manual_seed(n)
        logits = 4 * torch.randn(n, V, device=dev, generator=g)
        temp = torch.ones(n, device=dev)
        u = torch.rand(n, device=dev, generator=g)
        out = torch.empty(n, V, device=dev)
        ref = None
        for block, warps in settings:
            ts._MAX_BLOCK, ts._NUM_WARPS = block, warps
            tokens, _ = ts.draw_from_logits(logits, temp, u, out=out)
            same = None if ref is None else bool(torch.equal(tokens, ref))
            ref = tokens if ref is None else ref
            ms = time_replays(graphed(lambda: ts.draw_from_logits(logits, temp, u, out=out)), 200)
            result.append({"rows": n, "block": block, "warps": warps, "us": ms * 1e3, "same_tokens": same})
            print(f"rows {n}: block {block} x {warps} warps: {ms * 1e3:.1f} us (same tokens as the first: {same})",
                  flush=True)
    (out_dir / "sampling_kernels_tune.json").write_text(json.dumps(
        {"commit": os.environ.get("ADASPEC_COMMIT"), "device": torch.cuda.get_device_name(), "vocab": V,
         "results": result}, indent=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,256,2048")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--slots", type=int, default=7, help="the drafter's sequential draws per step")
    ap.add_argument("--tune", default=None, help="comma list of BLOCKxWARPS settings of the fused draw to time")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.tune:
        return tune(args, out_dir)
    keyed.compile_for_cuda()
    dev = torch.device("cuda")
    V = args.vocab
    rows, lines = [], []
    for n in (int(x) for x in args.rows.split(",")):
        g = torch.Generator(device=dev).manual_seed(n)
        logits = 4 * torch.randn(n, V, device=dev, generator=g)
        temp = torch.where(torch.arange(n, device=dev) % 4 == 3, 0.0, 1.0)
        seeds = torch.randint(0, 1 << 62, (n,), device=dev, generator=g)
        pos = torch.randint(0, 4000, (n,), device=dev, generator=g)
        ones, zeros = torch.ones_like(temp), torch.zeros_like(seeds)
        u = keyed_uniforms(seeds, pos + 1, SAMPLE)
        us = torch.rand(n, args.slots, device=dev, generator=g)
        q = torch.empty(n, args.slots, V, device=dev)

        def probs():
            return processed_probs(logits, temp, ones, zeros, any_filter=False, any_greedy=True)

        def draft_slots():  # the drafter's loop: slot j's logits would depend on slot j - 1's token
            tok = None
            for j in range(args.slots):
                lg = logits if tok is None else logits + (tok[:, None] == 0).float()
                tok, _ = sample_from_logits(lg, temp, ones, zeros, us[:, j], any_filter=False, any_greedy=True,
                                            out=q[:, j])
            return tok

        def three_kernels(t):  # the decode sampler before sample_tokens: probabilities, a draw, an argmax
            drawn = sample_categorical(processed_probs(logits, t, ones, zeros, any_filter=False, any_greedy=False), u)
            return torch.where(t <= 0, logits.argmax(-1), drawn)

        greedy = torch.zeros_like(temp)
        parts = {"processed_probs": probs,
                 "sample_categorical": lambda: sample_categorical(p_ref, u),
                 "plain decode sampler": lambda: sample_decode_rows(logits, temp, seeds, pos),
                 "plain as 3 kernels (before)": lambda: three_kernels(temp),
                 "plain, every row greedy": lambda: sample_decode_rows(logits, greedy, seeds, pos),
                 "every row greedy, 3 kernels": lambda: three_kernels(greedy),
                 f"drafter's {args.slots} slots": draft_slots}
        kernels.set_enabled(False)
        p_ref = probs()
        tok_ref = sample_categorical(p_ref, u)
        plain_ref = sample_decode_rows(logits, temp, seeds, pos)
        torch_ms = {k: time_replays(graphed(f), 200) for k, f in parts.items()}
        kernels.set_enabled(True)
        p_tri = probs()
        check = {"probs max abs diff": float((p_tri - p_ref).abs().max()),
                 "draws equal (same probs)": float((sample_categorical(p_ref, u) == tok_ref).float().mean()),
                 "plain sampler tokens equal": float((sample_decode_rows(logits, temp, seeds, pos) == plain_ref)
                                                     .float().mean()),
                 "plain sampler = 3 kernels": float((sample_decode_rows(logits, temp, seeds, pos)
                                                     == three_kernels(temp)).float().mean())}
        triton_ms = {k: time_replays(graphed(f), 200) for k, f in parts.items()}
        row = {"rows": n, "vocab": V, "check": check, "torch_ms": torch_ms, "triton_ms": triton_ms}
        rows.append(row)
        lines.append(f"rows {n}, vocab {V}: " + ", ".join(f"{k} {v:.3g}" for k, v in check.items()))
        for k in parts:
            lines.append(f"  {k:28s} torch {torch_ms[k] * 1e3:8.1f} us   triton {triton_ms[k] * 1e3:8.1f} us   "
                         f"x{torch_ms[k] / triton_ms[k]:.2f}")
        print("\n".join(lines[-len(parts) - 1:]), flush=True)
    (out_dir / "sampling_kernels.json").write_text(json.dumps(
        {"commit": os.environ.get("ADASPEC_COMMIT"), "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
