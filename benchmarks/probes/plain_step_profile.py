"""GPU probe: where a decode step of 256 requests goes, on the Qwen3-0.6B shape (random weights),
for the no-spec engine and for adaptive speculation forced into plain async steps (the steps it
runs when drafting does not pay). Per engine: wall ms per step over 30 steps, host ms per step
by function (cProfile), and the top CUDA kernels (torch.profiler). Writes $OUT/plain_step_profile.txt.

    python3 benchmarks/probes/plain_step_profile.py
"""
import cProfile
import io
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

N, STEPS = 256, 30


def engine(spec):
    llm = LLM(shape_model_dir("qwen3-0.6b", None), load_format="dummy", max_num_seqs=N, speculative_config=spec,
              skip_tokenizer_init=True, max_model_len=2048)
    eng = llm.llm_engine
    if spec:  # plain steps only: the policy never lets a step draft
        eng.spec.policy.should_draft = lambda *a: False
        eng.spec.policy.plain_step_done = lambda: False
    g = torch.Generator().manual_seed(0)
    for i in range(N):
        eng.add_request(str(i), torch.randint(1, 10000, (64,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(12):  # prefill, then a few decodes (graphs warm)
        eng.step()
    torch.cuda.synchronize()
    return eng


def profile(name, eng, out):
    t0 = time.perf_counter()
    for _ in range(STEPS):
        eng.step()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0) / STEPS
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(STEPS):
        eng.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    kernels = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    line = f"{name}: {wall:.3f} ms per step (wall, {STEPS} steps of {N} requests)"
    print(line, flush=True)
    out.write(f"==== {line}\n---- host (cProfile, {STEPS} steps)\n{s.getvalue()}\n---- kernels (10 steps)\n{kernels}\n")


def main():
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {"method": "synthetic", "num_speculative_tokens": 7, "enable_adaptive_verification": True,
            "synthetic_acceptance": [0.72, 0.68, 0.68, 0.71, 0.73, 0.78, 0.83], "draft_sample_method": "greedy"}
    with open(out_dir / "plain_step_profile.txt", "w") as out:
        for name, cfg in (("none", None), ("adaptive:7 plain async", spec)):
            eng = engine(cfg)
            profile(name, eng, out)
            del eng
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
