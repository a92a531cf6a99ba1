"""GPU probe: where the steps go under arrivals, per arm, at one concurrency: the closed loop of the
offline sweep (benchmarks/offline_sweep.py: waves x C short prompts, C in flight, every request
64 tokens), where most speculative steps are mixed (a few new prompts beside C decoding rows).
H200 run 19 (BENCHMARKS.md): at 256 requests of the code-0.6b pair a mixed speculative step took
13-17 ms against 5-6 ms for a decode-only one, with ~3 ms in the graphs; this says where the rest
goes. The Qwen3-0.6B shape with the pair's vocabulary (16384) on random weights, synthetic
acceptance from run 19's held-out T = 0 curve (timing only), so no pair build is needed.

Per arm, three passes over the same prompts after a warm-up wave:
  - timed: offline_sweep.run_point (throughput, step kinds, the engine's step split);
  - torch.profiler: each engine.step() call inside a record_function range, so the GPU activity
    (kernels, CUDA-graph replays' kernels, copies) that each step call launched is summed per step
    kind (step_kernel_us; prefill = the call ran prompt tokens; under pipelining a call also
    finishes the step before it, whose kernels it did not launch, so the time follows the launch),
    beside the pass's whole GPU activity (what the per-kind figures cover), the 20 costliest
    activities of each step kind by name (ms per step of that kind: two arms' lists side by side
    say which kernels one arm's steps add), and the pass's top kernels;
  - cProfile: the host's functions by own time.
A step kind whose wall time is well above its kernel time is host-bound there. Writes
$OUT/mixed_step_profile.txt and $OUT/mixed_step_profile.json.

    python3 benchmarks/probes/mixed_step_profile.py [--arms none,fixed:3,adaptive:7] [--concurrency 256]
        [--waves 4] [--prompt-len 170] [--output-len 64] [--shape qwen3-0.6b] [--shape-overrides JSON]
        [--device cuda]
CPU smoke test (a 2-layer shape): --device cpu --concurrency 4 --waves 2 --output-len 6
    --shape-overrides '{"num_hidden_layers": 2, "hidden_size": 256, ...}'
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
from bisect import bisect_right
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaspec import LLM, SamplingParams  # noqa: E402
from offline_sweep import GC_PAUSES, arm_config, run_point, shape_model_dir, sweep_arms_one_at_a_time  # noqa: E402
from plain_step_profile import device_events  # noqa: E402

# run 19's build (benchmarks/results/h200/run19/frontier_T0_606731a/pair.json), held-out T = 0
CURVE = [0.8422, 0.7431, 0.7395, 0.7419, 0.7444, 0.7630, 0.7739]
PAIR_VOCAB = {"vocab_size": 16384}


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def add_all(eng, ps, params, tag: str) -> None:
    for i, p in enumerate(ps):
        eng.add_request(f"{tag}{i}", p, params)


STEP = "adaspec.step"  # the record_function range around each engine.step() call


def _us(e) -> float:
    return e.time_range.end - e.time_range.start


def step_kernel_us(events, num_steps: int, tied: list | None = None) -> tuple[list[float] | None, float]:
    """(GPU activity us per step call, or None where the profile cannot tie them; us not tied to any).
    tied: a list that receives (step index, activity name, us) for every activity tied to a step.

    A record_function range appears twice: on the CPU (the step call) and on each stream's GPU
    timeline, as an annotation spanning the work that call launched, CUDA-graph replays included,
    with the CPU range's id. Each GPU activity (kernel, memcpy, memset) goes to the step whose
    annotation on the same stream began last before the activity began: on one stream work runs in
    launch order, so a pipelined step's kernels, queued behind the previous step's, still fall in
    its own span. The steps' annotations are matched to the step calls by id, else by order where
    each stream has one per call; otherwise None (and every activity counts as not tied)."""
    cpu_t = torch.autograd.DeviceType.CPU
    calls = sorted((e for e in events if e.name == STEP and e.device_type == cpu_t), key=lambda e: e.time_range.start)
    acts = [e for e in events if e.device_type != cpu_t and e.name != STEP]
    total = sum(_us(a) for a in acts)
    by_id = {e.id: i for i, e in enumerate(calls)}
    streams: dict = {}
    for g in (e for e in events if e.name == STEP and e.device_type != cpu_t):
        streams.setdefault((g.device_index, g.thread), []).append(g)
    spans: dict = {}
    for key, anns in streams.items():
        anns.sort(key=lambda e: e.time_range.start)
        if all(a.id in by_id for a in anns):
            spans[key] = [(a.time_range.start, by_id[a.id]) for a in anns]
        elif len(anns) == num_steps:
            spans[key] = [(a.time_range.start, i) for i, a in enumerate(anns)]
        else:
            return None, total
    per_step, loose = [0.0] * num_steps, 0.0
    for a in acts:
        marks = spans.get((a.device_index, a.thread), [])
        i = bisect_right(marks, (a.time_range.start, float("inf"))) - 1
        if i < 0:
            loose += _us(a)
        else:
            per_step[marks[i][1]] += _us(a)
            if tied is not None:
                tied.append((marks[i][1], a.name, _us(a)))
    return per_step, loose


def top_kernels_per_step(tied: list, kinds: list[str], kind: str, n: int = 20) -> list[tuple[str, float]]:
    """The n GPU activities with the most time in the steps of one kind, as (name, ms per step of
    that kind): where two arms' steps of a kind differ, by name (H100 run 63: the 8B shape's chunk
    steps cost 1-6% more with speculation, not yet split by kernel)."""
    steps = sum(1 for k in kinds if k == kind)
    if not steps:
        return []
    totals: dict[str, float] = {}
    for i, name, us in tied:
        if kinds[i] == kind:
            totals[name] = totals.get(name, 0.0) + us
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return [(name, round(us / steps / 1e3, 4)) for name, us in ranked]


def profiled_pass(eng, ps, params, cuda: bool) -> dict:
    """GPU activity ms per step call, by kind, from a record_function range around each engine.step()."""
    add_all(eng, ps, params, "prof")
    kinds, walls = [], []
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        while eng.has_unfinished_requests():
            p0, t0 = eng.stats.num_prompt_tokens, time.perf_counter()
            with torch.profiler.record_function(STEP):
                eng.step()
            walls.append(time.perf_counter() - t0)
            kinds.append("prefill" if eng.stats.num_prompt_tokens > p0 else "decode")
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    calls = sum(1 for e in events if e.name == STEP and e.device_type == torch.autograd.DeviceType.CPU)
    if calls != len(kinds):
        raise SystemExit(f"the profiler kept {calls} step ranges of {len(kinds)} step calls")
    tied: list = []
    per_step, loose = step_kernel_us(events, len(kinds), tied) if cuda else (None, 0.0)
    out = {}
    for kind in ("prefill", "decode"):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        gpu = None if per_step is None or not idx else round(sum(per_step[i] for i in idx) / len(idx) / 1e3, 3)
        wall = round(1e3 * sum(walls[i] for i in idx) / len(idx), 3) if idx else None
        out[kind] = dict(steps=len(idx), kernel_ms_per_step=gpu, wall_ms_per_step_profiled=wall,
                         top_kernels_ms_per_step=top_kernels_per_step(tied, kinds, kind))
    # every GPU activity of the pass, tied to a step or not: what the per-kind figures cover
    total = sum(e.time_range.elapsed_us() for e in device_events(prof, annotations=(STEP,))) / 1e3
    out["kernel_ms_total"] = round(total, 3)
    not_tied = loose / 1e3 if per_step is not None else (total if cuda else 0.0)
    out["kernel_ms_not_tied_to_a_step"] = round(not_tied, 3)
    out["wall_ms_total_profiled"] = round(1e3 * sum(walls), 3)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    out["top_kernels"] = prof.key_averages().table(sort_by=sort, row_limit=25)
    return out


def host_pass(eng, ps, params) -> str:
    add_all(eng, ps, params, "host")
    pr = cProfile.Profile()
    pr.enable()
    while eng.has_unfinished_requests():
        eng.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    return s.getvalue()


def load_arm(arm: str, args, model_dir: str):
    cfg = arm_config(arm, None, 0.0, {"synthetic_acceptance": CURVE})
    return (LLM(model_dir, load_format="dummy", max_num_seqs=args.concurrency, speculative_config=cfg,
                skip_tokenizer_init=True, max_model_len=args.prompt_len + args.output_len + 16, device=args.device),)


def profile_arm(arm: str, llm, args, out) -> dict:
    """The three passes over one arm's engine (loaded, its start-up heap frozen, by the caller)."""
    eng, c = llm.llm_engine, args.concurrency
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    n = args.waves * c
    vocab = eng.model_config.vocab_size
    run_point(llm, prompts(c, args.prompt_len, 1, vocab), params)  # warm-up: graphs, allocator, the policy
    gc.freeze()  # what the warm-up built too, as the offline sweep does
    row = run_point(llm, prompts(n, args.prompt_len, 2, vocab), params)
    gpu = profiled_pass(eng, prompts(n, args.prompt_len, 3, vocab), params, args.device == "cuda")
    host = host_pass(eng, prompts(n, args.prompt_len, 4, vocab), params)
    kinds = row["step_kinds"]
    lines = [f"{arm} @ {c}: {row['output_throughput']:.0f} out tok/s, {row['duration']:.2f} s"]
    for kind in ("prefill", "decode"):
        k, g = kinds[kind], gpu[kind]
        lines.append(f"  {kind:7s}: {k['steps']} steps, wall {k['ms_per_step']} ms/step (timed pass); "
                     f"kernels launched {g['kernel_ms_per_step']} ms/step, wall {g['wall_ms_per_step_profiled']} "
                     f"ms/step (profiled pass, {g['steps']} steps)")
    lines.append(f"  GPU activity in the profiled pass: {gpu['kernel_ms_total']} ms "
                 f"({gpu['kernel_ms_not_tied_to_a_step']} ms not tied to a step call), "
                 f"over {gpu['wall_ms_total_profiled']} ms of step calls")
    lines.append(f"  step split (timed pass): {json.dumps(row['step_split'])}")
    for kind in ("prefill", "decode"):
        for name, ms in gpu[kind]["top_kernels_ms_per_step"]:
            lines.append(f"    {kind} kernel {ms:9.4f} ms/step  {name[:110]}")
    print("\n".join(lines), flush=True)
    out.write("==== " + "\n".join(lines) + f"\n---- host (cProfile by own time, one pass)\n{host}\n"
              f"---- kernels (profiled pass)\n{gpu.pop('top_kernels')}\n")
    return dict(arm=arm, concurrency=c, timed=row, profiled=gpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="none,fixed:3,adaptive:7")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=170,
                    help="prompt tokens (eval-code's prompts, capped at 256 tokens as the sweeps cap them, average "
                         "177 with the tiny pair's 8k-token vocabulary; run 19's no-spec arm at 256 ran 49 prefill "
                         "steps, this probe at 150 tokens 40)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--shape-overrides", default=json.dumps(PAIR_VOCAB))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    for name in ("concurrency", "waves", "prompt_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    GC_PAUSES.start()  # the timed pass records the collector's pauses, as the sweep's points do
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (give --device cpu for a smoke test)")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = shape_model_dir(args.shape, args.shape_overrides)
    rows = []
    with open(out_dir / "mixed_step_profile.txt", "w") as out:
        out.write(f"synthetic acceptance: timing only ({', '.join(map(str, CURVE))}); {vars(args)}\n")
        # one engine at a time, each freed before the next loads (its KV cache is sized from free memory)
        sweep_arms_one_at_a_time(args.arms.split(","), lambda arm: load_arm(arm, args, model_dir),
                                 lambda arm, llm: rows.append(profile_arm(arm, llm, args, out)), freeze=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    (out_dir / "mixed_step_profile.json").write_text(json.dumps(
        dict(commit=os.environ.get("ADASPEC_COMMIT"), device=device, args=vars(args),
             synthetic_acceptance="timing only", curve=CURVE, rows=rows), indent=1, default=str))


if __name__ == "__main__":
    main()
