"""GPU probe: what the sampler's kernels cost, op by op, on random logits.

H200 run 35's first plain_sampling_ab.py run seemed to show a decode step at T = 1 taking 1.35 ms
more GPU time than the greedy step at 256 requests (4.95 against 3.59 ms), for a few passes over
a [256, 16384] float32 block; its greedy steps ran at shorter contexts, and this probe found the
sampler's kernels at 141 us a call there (BENCHMARKS.md, run 35). This times each
part of the sampler (processed_probs, keyed_uniforms, sample_categorical and its cumsum and
searchsorted) with CUDA events at N rows (1, 256, and 2048: 256 requests verifying 8 tokens each),
the whole sampler eagerly and torch.compile'd, and prints the top kernels of the whole sampler
under torch.profiler. Writes $OUT/sampling_kernels.json.

    python3 benchmarks/probes/sampling_kernels.py [--rows 1,256,2048] [--vocab 16384]
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
from adaspec.engine.graphed_sampling import sample_decode_rows  # noqa: E402
from adaspec.sample import random as keyed  # noqa: E402
from adaspec.sample.probs import processed_probs  # noqa: E402
from adaspec.sample.random import SAMPLE, keyed_uniforms, sample_categorical  # noqa: E402
from spec_step_profile import time_replays  # noqa: E402  (CUDA-event ms per call)


def _sampler_for_compile(logits, temperature, seeds, positions):
    """sample_decode_rows with the keyed hash written out (the engine's keyed_uniforms looks its
    compiled kernel up in a dict, which torch.compile cannot trace)."""
    probs = processed_probs(logits, temperature, torch.ones_like(temperature), torch.zeros_like(seeds),
                            any_filter=False, any_greedy=False)
    drawn = sample_categorical(probs, keyed._keyed_uniforms(seeds, positions + 1, SAMPLE, None))
    return torch.where(temperature <= 0, logits.argmax(-1), drawn)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,256,2048")
    ap.add_argument("--vocab", type=int, default=16384)
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    keyed.compile_for_cuda()
    dev = torch.device("cuda")
    V = args.vocab
    compiled = torch.compile(_sampler_for_compile, dynamic=False, fullgraph=True)
    rows = []
    for n in (int(x) for x in args.rows.split(",")):
        g = torch.Generator(device=dev).manual_seed(n)
        logits = 4 * torch.randn(n, V, device=dev, generator=g)
        temp = torch.full((n,), 1.0, device=dev)
        seeds = torch.randint(0, 1 << 62, (n,), device=dev, generator=g)
        pos = torch.randint(0, 4000, (n,), device=dev, generator=g)
        ones, zeros = torch.ones_like(temp), torch.zeros_like(seeds)
        probs = processed_probs(logits, temp, ones, zeros, any_filter=False, any_greedy=False)
        u = keyed_uniforms(seeds, pos + 1, SAMPLE)
        cum = probs.cumsum(-1)
        target = (u[:, None] * cum[:, -1:]).contiguous()
        try:
            same = torch.equal(compiled(logits, temp, seeds, pos), sample_decode_rows(logits, temp, seeds, pos))
        except Exception as e:  # noqa: BLE001 - a probe: report and go on without the compiled variant
            print(f"compiling the sampler failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            same = None
        print(f"rows {n}: the compiled sampler draws the same tokens: {same}", flush=True)
        parts = {
            "argmax (greedy)": lambda: logits.argmax(-1),
            "processed_probs": lambda: processed_probs(logits, temp, ones, zeros, any_filter=False, any_greedy=False),
            "softmax alone": lambda: torch.softmax(logits, -1),
            "keyed_uniforms": lambda: keyed_uniforms(seeds, pos + 1, SAMPLE),
            "sample_categorical": lambda: sample_categorical(probs, u),
            "cumsum alone": lambda: probs.cumsum(-1),
            "searchsorted alone": lambda: torch.searchsorted(cum, target, right=True),
            "whole sampler": lambda: sample_decode_rows(logits, temp, seeds, pos),
        }
        if same is not None:
            parts["whole sampler, compiled"] = lambda: compiled(logits, temp, seeds, pos)
        row = {"rows": n, "vocab": V, "ms": {k: time_replays(f, 50) for k, f in parts.items()}}
        rows.append(row)
        print(f"rows {n}, vocab {V}: " + ", ".join(f"{k} {v * 1e3:.0f} us" for k, v in row["ms"].items()), flush=True)
        if n == 256:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    sample_decode_rows(logits, temp, seeds, pos)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
            print(table, flush=True)
            row["kernels"] = table
    (out_dir / "sampling_kernels.json").write_text(json.dumps(
        {"commit": os.environ.get("ADASPEC_COMMIT"), "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
