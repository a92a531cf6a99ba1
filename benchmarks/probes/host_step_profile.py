"""GPU probe: where the host's time goes in a decode step at high concurrency, per arm.

H200 run 34's offline sweep at 256 requests logged 4.8-5.8 ms of host bookkeeping in a 12-14 ms
speculative step (the step's stats: `bookkeeping_ms`), and 10.4 ms of wall time for a no-spec step
that the cost tables price at 2.7 ms of GPU work. This probe runs each arm's engine on the
Qwen3-0.6B shape with the code-0.6b pair's vocabulary (16384; random weights, synthetic acceptance
at the given curve: timing only) with N requests decoding, then profiles STEPS engine steps with
cProfile: the functions by their own time, and the engine's per-step split (stats) with and
without the profiler (the profiler slows Python ~1.5-2x, so its shares, not its times, are what
to read). Writes $OUT/host_step_profile.txt (and prints each arm's summary as it goes).

--gc freeze (the default) freezes what start-up built, as `adaspec serve` and offline_sweep.py do;
--output-kind final_only (the default) reports a request only when it ends, as LLM.generate and
the offline sweep do. H200 run 34's first run of this probe had neither (the collector as is, an
output per request per step): 330 ms over 60 steps were charged to a one-line generator in
GraphedForward.pick (no-spec), most likely one full collection striking there (one costs ~137 ms
in this state on the development machine's faster CPU: benchmarks/host_step_bench.py --gc as-is).

    python3 benchmarks/probes/host_step_profile.py [--batch 256] [--arms none,fixed:3,adaptive:7]
        [--steps 60] [--temperature 1] [--shape-overrides JSON] [--device cuda]
        [--gc freeze|as-is] [--output-kind final_only|cumulative]
"""
import argparse
import cProfile
import gc
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
from adaspec.sampling_params import RequestOutputKind  # noqa: E402
from offline_sweep import shape_model_dir  # noqa: E402

CURVE = [0.80, 0.71, 0.66, 0.64, 0.62, 0.61, 0.60]  # run 34's build 2, held-out T = 1


def speculative_config(arm: str):
    if arm == "none":
        return None
    kind, _, k = arm.partition(":")
    if kind not in ("fixed", "adaptive") or not k.isdigit() or int(k) < 1:
        raise SystemExit(f"--arms: {arm!r} is not none, fixed:K or adaptive:K (K a positive integer)")
    return {"method": "synthetic", "num_speculative_tokens": int(k), "synthetic_acceptance": CURVE[:int(k)],
            "enable_adaptive_verification": kind == "adaptive"}


def build(arm: str, n: int, model_dir: str, temperature: float, device: str, output_kind: RequestOutputKind):
    llm = LLM(model_dir, load_format="dummy", max_num_seqs=n, speculative_config=speculative_config(arm),
              skip_tokenizer_init=True, max_model_len=2048, device=device)
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    vocab = min(10000, eng.model_config.vocab_size)
    for i in range(n):
        eng.add_request(str(i), torch.randint(1, vocab, (64,), generator=g).tolist(),
                        SamplingParams(temperature=temperature, max_tokens=1500, ignore_eos=True,
                                       output_kind=output_kind))
    for _ in range(20):  # prefill, then steady decoding
        eng.step()
    return eng


def split(eng, before: dict, steps: int, wall: float) -> dict:
    s = eng.stats
    per = {k: round((getattr(s, k) - before[k]) * 1e3 / steps, 3) for k in before}
    per["wall"] = round(wall * 1e3 / steps, 3)
    return per


def snapshot(eng) -> dict:
    s = eng.stats
    return {k: getattr(s, k) for k in ("time_draft", "time_verify", "time_sample", "time_bookkeeping", "time_graphed")}


def sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--arms", default="none,fixed:3,adaptive:7")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--shape-overrides", default='{"vocab_size": 16384}')
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gc", choices=("freeze", "as-is"), default="freeze")
    ap.add_argument("--output-kind", choices=("final_only", "cumulative"), default="final_only")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = shape_model_dir("qwen3-0.6b", args.shape_overrides)
    report, summary = [], {}
    for arm in args.arms.split(","):
        kind = RequestOutputKind.FINAL_ONLY if args.output_kind == "final_only" else RequestOutputKind.CUMULATIVE
        eng = build(arm, args.batch, model_dir, args.temperature, args.device, kind)
        if args.gc == "freeze":
            gc.collect()
            gc.freeze()
        # the same number of steps unprofiled, then profiled
        sync(args.device)
        before, t0 = snapshot(eng), time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        sync(args.device)
        plain = split(eng, before, args.steps, time.perf_counter() - t0)
        prof = cProfile.Profile()
        before, t0 = snapshot(eng), time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            eng.step()
        sync(args.device)
        prof.disable()
        profiled = split(eng, before, args.steps, time.perf_counter() - t0)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        buf.write("\nadaspec's functions by cumulative time:\n")
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats("adaspec", args.top)
        line = f"{arm} at {args.batch} requests, ms per step: unprofiled {plain}; profiled {profiled}"
        print(line, flush=True)
        summary[arm] = {"unprofiled": plain, "profiled": profiled}
        report.append(f"==== {line}\n{buf.getvalue()}")
        (out_dir / "host_step_profile.txt").write_text("\n".join(report))  # kept as it goes
        del eng
        gc.unfreeze()  # the next arm's start-up frozen afresh; this engine's cycles collectable
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    (out_dir / "host_step_profile.json").write_text(json.dumps(
        {"batch": args.batch, "steps": args.steps, "temperature": args.temperature, "curve": CURVE,
         "gc": args.gc, "output_kind": args.output_kind,
         "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
         "torch": torch.__version__, "arms": summary}, indent=2))


if __name__ == "__main__":
    main()
