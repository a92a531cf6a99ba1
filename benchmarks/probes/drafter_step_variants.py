"""GPU probe: does the drafter's training step wait on the host, and which change of the step takes
that wait away? In the code-0.6b builds the drafter's step took 56-70 ms of wall time for 47-48 ms
of CUDA kernels (H200 runs 28-31; run 31's slow host made 2,147 steps in the 2.5-minute box where
run 30's made 2,805-2,903, and its held-out tau was the lowest of five builds): the step is the
loop's own (`adaspec.train.drafter.forward_backward`, then grad clipping and AdamW), on a
random-weight target of the preset's shape and random tokens at the preset's batch (32 x 256
tokens, 64 anchors, k = 7, 2 layers), with the batch copied from pinned host memory as the loop
does. The target's layers and the loss are compiled in every variant (the recipe's --compile).

Variants (each on a fresh drafter with the same initial weights):
  recipe    AdamW foreach (the recipe up to 2026-12-03)
  fused     AdamW fused (--adamw-impl fused, the default on CUDA since)
  compiled  AdamW foreach, the drafter's training pass compiled (--compile-drafter)
  both      fused and compiled
  captured  both, the whole step replayed as one CUDA graph after 3 ordinary steps (--cuda-graph-step;
            AdamW capturable, autocast without its cache, every step of it on one side stream)

Checks first that every variant's loss on one batch from the same weights matches the recipe's
(bf16 autocast: relative 2e-2), and stops if one does not. Then times them in the order
ABCD DCBA (the host's speed drifts within a command), --steps steps each after --warmup steps (the
first step of each variant, timed apart, holds its compilation; the compiled graphs are reused by
a later variant with the same drafter pass, so only the first compiled variant shows it), and profiles --profile-steps
steps of each for their CUDA kernel time. Prints a table (wall ms per step, kernel ms per step,
steps that fit in the recipe's 2.5 minutes) and writes $OUT/drafter_step_variants.json.

    python3 benchmarks/probes/drafter_step_variants.py [--steps 30]
    python3 benchmarks/probes/drafter_step_variants.py --preset micro --variants recipe,fused --steps 2 --warmup 1  # CPU smoke test
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec.h2d import to_device  # noqa: E402
from adaspec.models.drafter import DrafterConfig, DSparkDrafter  # noqa: E402
from adaspec.models.loader import load_target  # noqa: E402
from adaspec.train.captured_step import WARM_STEPS, CapturedStep  # noqa: E402
from adaspec.train.drafter import (_compile, compile_drafter_training, drafter_optimizer, forward_backward,  # noqa: E402
                                   init_drafter)
from adaspec.train.drafter_loss import dspark_loss, sample_anchors  # noqa: E402
from adaspec.train.pair_presets import PRESETS  # noqa: E402
from qwen3_shapes import write_preset_shape  # noqa: E402

VARIANTS = {"recipe": ("foreach", False), "fused": ("fused", False), "compiled": ("foreach", True), "both": ("fused", True),
            "captured": ("fused", True)}
CAPTURED = {"captured"}  # the step replayed as one CUDA graph (train/captured_step.py) after WARM_STEPS ordinary ones


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="code-0.6b", help="micro: a CPU smoke test of this script")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--variants", default="recipe,fused,compiled,both")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=3)
    args = ap.parse_args()
    names = args.variants.split(",")
    if unknown := [n for n in names if n not in VARIANTS]:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[args.preset]
    d = preset["drafter"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    target, tcfg = load_target(write_preset_shape(args.preset, args.vocab, tempfile.mkdtemp()), dtype="bfloat16" if cuda else "float32",
                               device=dev, load_format="dummy")
    for p in target.parameters():
        p.requires_grad_(False)
    dcfg = DrafterConfig.from_target(tcfg, mask_token_id=3, block_size=d["block_size"], num_layers=d["layers"],
                                     markov_rank=d["markov_rank"])
    B, T, A = d["batch_size"], d["seq_len"], d["anchors_per_seq"]
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    loss_fn, compiled = _compile(target, dspark_loss)
    print(f"target layers and loss compiled: {compiled}; device {torch.cuda.get_device_name(dev) if cuda else 'cpu'}; "
          f"batch {B} x {T}, {A} anchors, k {dcfg.block_size}, {dcfg.num_layers} drafter layer(s)", flush=True)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(4, args.vocab, (B, T), generator=g), sample_anchors(B, T, dcfg.block_size, A, g))
               for _ in range(8)]

    amp_no_cache = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if cuda else amp
    streams, graphs, counts = {}, {}, {}

    def fresh(name):
        impl, compile_drafter = VARIANTS[name]
        drafter = DSparkDrafter(dcfg)
        init_drafter(drafter, target, 0, from_target=True)
        drafter.to(dev)
        drafter.rope.build_tables(device=dev)
        if compile_drafter:
            compile_drafter_training(drafter)
        params = [p for p in drafter.parameters() if p.requires_grad]
        captured = name in CAPTURED and cuda
        if captured:
            streams[id(drafter)] = torch.cuda.Stream(dev)
        return drafter, params, drafter_optimizer(params, 1e-3, dev, impl, capturable=captured)

    def one_step(drafter, params, opt, ids, anchors, use_amp):
        loss, _ = forward_backward(target, drafter, loss_fn, use_amp, ids, anchors, d["gamma"])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.detach()

    def step(drafter, params, opt, i):
        ids, anchors = batches[i % len(batches)]
        side = streams.get(id(drafter))
        if side is None:
            ids, anchors = to_device(ids, dev), to_device(anchors, dev)  # pinned, asynchronous: as the loop
            opt.zero_grad(set_to_none=True)
            return one_step(drafter, params, opt, ids, anchors, amp)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # as the loop with --cuda-graph-step: one side stream for all
            ids, anchors = to_device(ids, dev), to_device(anchors, dev)
            key = id(drafter)
            counts[key] = counts.get(key, 0) + 1
            graph = graphs.get(key)
            if graph is None and counts[key] > WARM_STEPS:
                graph = graphs[key] = CapturedStep(
                    lambda ids, anchors: one_step(drafter, params, opt, ids, anchors, amp_no_cache),
                    {"ids": ids, "anchors": anchors}, lambda: opt.zero_grad(set_to_none=True))
                graph.capture()
            if graph is None:
                opt.zero_grad(set_to_none=True)
                loss = one_step(drafter, params, opt, ids, anchors, amp_no_cache)
            else:
                graph.load(ids=ids, anchors=anchors)
                loss = graph.replay()
        torch.cuda.current_stream(dev).wait_stream(side)
        return loss

    states, first_loss, compile_s = {}, {}, {}
    for name in names:  # the first step of each: its loss from the common start, and its compilation
        states[name] = fresh(name)
        t0 = time.perf_counter()
        first_loss[name] = float(step(*states[name], 0).detach())
        sync()
        compile_s[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: first step {compile_s[name]} s, loss {first_loss[name]:.5f}", flush=True)
    ref = first_loss[names[0]]
    bad = {n: x for n, x in first_loss.items() if abs(x - ref) > 2e-2 * abs(ref)}
    if bad:
        raise SystemExit(f"losses differ from {names[0]}'s {ref:.5f} on the same batch and weights: {bad}")

    wall = {n: [] for n in names}
    for name in names + names[::-1]:
        drafter, params, opt = states[name]
        for i in range(args.warmup):
            step(drafter, params, opt, i)
        sync()
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(drafter, params, opt, i)
        sync()
        wall[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
        print(f"{name}: {wall[name][-1]:.1f} ms per step", flush=True)

    kernel_ms = {}
    for name in names:
        if not cuda or args.profile_steps < 1:
            kernel_ms[name] = None
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(args.profile_steps):
                step(*states[name], i)
            sync()
        total_us = sum(e.self_device_time_total for e in prof.key_averages())
        kernel_ms[name] = round(total_us / 1e3 / args.profile_steps, 2)

    budget_s = (d.get("max_minutes") or 2.5) * 60
    rows = []
    lines = [f"{'variant':<10}{'wall ms/step':>16}{'kernels ms/step':>17}{'steps in ' + str(int(budget_s)) + ' s':>16}"
             f"{'first step s':>14}{'loss 1':>10}"]
    for name in names:
        ms = statistics.mean(wall[name])
        rows.append({"variant": name, "adamw_impl": VARIANTS[name][0], "compile_drafter": VARIANTS[name][1],
                     "wall_ms_per_step": [round(x, 2) for x in wall[name]], "mean_wall_ms_per_step": round(ms, 2),
                     "kernel_ms_per_step": kernel_ms[name], "first_step_s": compile_s[name],
                     "first_loss": first_loss[name], "steps_in_budget": int(budget_s * 1e3 / ms)})
        wall_s = " / ".join(f"{x:.1f}" for x in wall[name])
        lines.append(f"{name:<10}{wall_s:>16}{'-' if kernel_ms[name] is None else kernel_ms[name]:>17}"
                     f"{rows[-1]['steps_in_budget']:>16}{compile_s[name]:>14}{first_loss[name]:>10.4f}")
    print("\n".join(lines), flush=True)
    (out_dir / "drafter_step_variants.json").write_text(json.dumps(
        {"preset": args.preset, "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
         "batch": {"rows": B, "seq_len": T, "anchors": A, "k": dcfg.block_size, "layers": dcfg.num_layers},
         "steps": args.steps, "warmup": args.warmup, "order": names + names[::-1], "target_compiled": compiled,
         "variants": rows}, indent=1))


if __name__ == "__main__":
    main()
