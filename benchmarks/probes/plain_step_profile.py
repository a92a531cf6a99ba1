"""GPU probe: where a decode step goes, on the Qwen3-0.6B shape (random weights), per engine and
batch size: the no-spec engine, adaptive speculation forced into plain async steps (the steps it
runs when drafting does not pay), and fixed:7 (every step drafts; synthetic acceptance). Per
engine: wall ms per step over 30 steps, GPU kernel ms per step (torch.profiler, 10 steps: the
sum of kernel times; one stream, so they do not overlap), host ms per step by function
(cProfile, sorted by own time) and the top kernels. A step whose wall time is well above its
kernel time is host-bound. Writes $OUT/plain_step_profile.txt and $OUT/plain_step_profile.json.

    python3 benchmarks/probes/plain_step_profile.py [--batch 1,16,256] [--modes none,plain,fixed]
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec import LLM, SamplingParams  # noqa: E402
from offline_sweep import shape_model_dir  # noqa: E402

STEPS = 30
CURVE = [0.72, 0.68, 0.68, 0.71, 0.73, 0.78, 0.83]


def spec_config(mode):
    if mode == "none":
        return None
    return {"method": "synthetic", "num_speculative_tokens": 7, "enable_adaptive_verification": mode == "plain",
            "synthetic_acceptance": CURVE, "draft_sample_method": "greedy"}


def engine(mode, n, model_dir):
    llm = LLM(model_dir, load_format="dummy", max_num_seqs=n, speculative_config=spec_config(mode),
              skip_tokenizer_init=True, max_model_len=4096)
    eng = llm.llm_engine
    if mode == "plain":  # plain steps only: the policy never lets a step draft
        eng.spec.policy.should_draft = lambda *a, **kw: False
        eng.spec.policy.plain_step_done = lambda *a: False
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        eng.add_request(str(i), torch.randint(1, 10000, (64,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True))
    for _ in range(12):  # prefill, then a few decodes (graphs warm)
        eng.step()
    torch.cuda.synchronize()
    return eng


def device_events(prof, annotations=()):
    """The profiled window's GPU activities (kernels, memcpy, memset), each once: the events on the
    device's timeline, without the GPU-side copies of record_function ranges named in annotations.
    (Summing key_averages()' self device times, as this probe did until 2026-12-02, counted each
    eager kernel twice: once as the kernel's row and once as the launching op's; graph kernels
    once: run 11's 1.504 ms/step against the table's 1.475.)"""
    return [e for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU and e.name not in annotations]


def kernel_ms(prof):
    """Sum of the GPU activities' durations in ms over the profiled window (one stream: no overlap)."""
    return sum(e.time_range.elapsed_us() for e in device_events(prof)) / 1e3


def profile(name, eng, out):
    gen0 = eng.stats.num_generated_tokens
    t0 = time.perf_counter()
    for _ in range(STEPS):
        eng.step()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0) / STEPS
    tokens = (eng.stats.num_generated_tokens - gen0) / STEPS
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(STEPS):
        eng.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    gpu = kernel_ms(prof) / 10
    kernels = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
    line = (f"{name}: wall {wall:.3f} ms/step, GPU kernels {gpu:.3f} ms/step, "
            f"{tokens:.1f} tokens/step ({STEPS} steps)")
    print(line, flush=True)
    out.write(f"==== {line}\n---- host (cProfile by own time, {STEPS} steps)\n{s.getvalue()}\n"
              f"---- kernels (10 steps)\n{kernels}\n")
    return {"engine": name, "wall_ms_per_step": wall, "gpu_kernel_ms_per_step": gpu, "tokens_per_step": tokens}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16,256")
    ap.add_argument("--modes", default="none,plain,fixed")
    ap.add_argument("--shape", default="qwen3-0.6b")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = shape_model_dir(args.shape, None)
    names = {"none": "none", "plain": "adaptive:7 plain async", "fixed": "fixed:7 synthetic"}
    rows = []
    with open(out_dir / "plain_step_profile.txt", "w") as out:
        for n in (int(x) for x in args.batch.split(",")):
            for mode in args.modes.split(","):
                eng = engine(mode, n, model_dir)
                rows.append({"batch": n, "shape": args.shape, **profile(f"{names[mode]} @ {n}", eng, out)})
                eng.shutdown()
                del eng
                torch.cuda.empty_cache()
    (out_dir / "plain_step_profile.json").write_text(json.dumps(
        {"commit": os.environ.get("ADASPEC_COMMIT"), "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
