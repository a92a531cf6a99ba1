"""GPU probe: does the first served step after startup stall, with and without the engine's
startup warm-up requests (engine/warm_up.py)? H200 run 25 logged a 701 ms first step (one
71-token prompt alone, right after 8 prompts together) in the adaptive arm's server.

The traffic of a served sweep's start, on the Qwen3-0.6B shape with the pair's vocabulary (random
weights, synthetic acceptance: timing only), sampled (T = 1), 64 output tokens:
  "bench warm-up": 8 prompts at once (what `bench sweep --num-warmups 8` sends first);
  "first point":   one 71-token prompt alone, then 15 more after its first step (C = 16);
  "second point":  the same again (the steady state to compare with).
Each (arm, warm_up_requests) runs in a fresh process (Dynamo's in-memory caches start empty).
Prints, per phase, the step count, median and max step ms and the steps over --slow-ms, and the
torch.compile graphs compiled after the engine was ready; writes $OUT/first_request_stall.json
(rewritten after each process). H200 run 26: ~50-65 s per adaptive process, ~30 s per fixed one.

    python3 benchmarks/probes/first_request_stall.py [--arms adaptive:7,fixed:7] [--repeats 2] [--output-len 64]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CURVE = [0.7368, 0.6615, 0.6646, 0.6760, 0.7110, 0.7364, 0.7361]  # run 10's pair, held-out T = 0
LENGTHS = [71, 370, 183, 187, 491, 86, 211, 226, 120, 278, 287, 202, 169, 171, 123, 289]  # run 25's first prompts


def one(arm: str, warm: bool, model_dir: str, slow_ms: float, output_len: int = 64) -> dict:
    import torch

    from adaspec import LLM, SamplingParams
    from adaspec.engine.slow_steps import dynamo_graphs_compiled as _graphs
    from offline_sweep import arm_config

    t0 = time.perf_counter()
    llm = LLM(model_dir, load_format="dummy", max_num_seqs=64, skip_tokenizer_init=True, max_model_len=2048,
              warm_up_requests=warm,
              speculative_config=arm_config(arm, None, 1.0, {"synthetic_acceptance": CURVE,
                                                            "synthetic_confidence_noise": 0.05}))
    eng = llm.llm_engine
    startup_s = time.perf_counter() - t0
    print("PROBE: engine ready", file=sys.stderr, flush=True)  # the slow-step lines before it are startup's
    graphs0 = _graphs()
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, min(10000, vocab), (n,), generator=g).tolist() for n in LENGTHS]
    serial = 0

    def add(prompt):
        nonlocal serial
        serial += 1
        eng.add_request(f"r{serial}", prompt, SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True,
                                                             seed=serial))

    phases = {}
    for name in ("bench warm-up", "first point", "second point"):
        if name == "bench warm-up":
            for p in prompts[:8]:
                add(p)
            later = []
        else:
            add(prompts[0])
            later = prompts[1:]
        ms = []
        while eng.has_unfinished_requests() or later:
            t = time.perf_counter()
            eng.step()
            ms.append(1e3 * (time.perf_counter() - t))
            if later:  # the others arrive after the first one's first step
                for p in later:
                    add(p)
                later = []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        phases[name] = {"steps": len(ms), "first_ms": round(ms[0], 2), "median_ms": round(statistics.median(ms), 3),
                        "max_ms": round(max(ms), 2), "over_slow_ms": sum(x > slow_ms for x in ms),
                        "graphs_compiled_so_far": _graphs() - graphs0}
    warm_result = eng.warm_up_result
    return {"arm": arm, "warm_up_requests": warm, "startup_s": round(startup_s, 1),
            "warm_up": None if warm_result is None else vars(warm_result), "phases": phases}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default="adaptive:7,fixed:7")
    ap.add_argument("--slow-ms", type=float, default=30.0)
    ap.add_argument("--shape-overrides", default='{"vocab_size": 16384}', help="e.g. fewer layers for a CPU smoke test")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1,
                    help="processes per (arm, warm_up_requests), the order alternating (off, on, then on, off, ...): "
                         "H200 run 27 saw the plain arm's median step 27%% slower after the warm-up in one process each")
    ap.add_argument("--child", nargs=3, metavar=("ARM", "WARM", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        arm, warm, model_dir = args.child
        print("RESULT " + json.dumps(one(arm, warm == "1", model_dir, args.slow_ms, args.output_len)), flush=True)
        return
    from offline_sweep import shape_model_dir

    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = shape_model_dir("qwen3-0.6b", args.shape_overrides)
    env = dict(os.environ, ADASPEC_LOG_SLOW_STEPS_MS=os.environ.get("ADASPEC_LOG_SLOW_STEPS_MS", str(args.slow_ms)))
    results = []
    runs = [(arm, repeat, warm) for arm in args.arms.split(",") for repeat in range(args.repeats)
            for warm in ((False, True) if repeat % 2 == 0 else (True, False))]
    for arm, repeat, warm in runs:
        p = subprocess.run([sys.executable, __file__, "--slow-ms", str(args.slow_ms), "--output-len",
                            str(args.output_len), "--child", arm, "1" if warm else "0", model_dir],
                           env=env, capture_output=True, text=True)
        lines = p.stderr.splitlines()
        ready = next((i for i, ln in enumerate(lines) if ln.startswith("PROBE: engine ready")), len(lines))
        slow = [("after ready: " if i > ready else "startup: ") + ln[ln.index("slow engine step"):][:400]
                for i, ln in enumerate(lines) if "slow engine step" in ln]
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if p.returncode or line is None:
            print(f"{arm} warm_up_requests={warm} (repeat {repeat}): failed (exit {p.returncode})\n"
                  f"{p.stderr[-3000:]}", flush=True)
            results.append({"arm": arm, "warm_up_requests": warm, "repeat": repeat, "error": p.stderr[-3000:]})
            continue
        r = json.loads(line[len("RESULT "):])
        r["slow_step_log"], r["repeat"] = slow, repeat
        results.append(r)
        wu = r["warm_up"]
        print(f"{arm} warm_up_requests={warm} (repeat {repeat}): startup {r['startup_s']} s"
              + (f" (warm-up {wu['requests']} requests, {wu['steps']} steps, {wu['seconds']:.1f} s)" if wu else ""),
              flush=True)
        for name, ph in r["phases"].items():
            print(f"    {name:<14} {ph['steps']:4d} steps  first {ph['first_ms']:8.2f} ms  median {ph['median_ms']:7.3f}"
                  f"  max {ph['max_ms']:8.2f}  >{args.slow_ms:g} ms: {ph['over_slow_ms']:3d}"
                  f"  graphs compiled since ready: {ph['graphs_compiled_so_far']}", flush=True)
        for s in [x for x in slow if x.startswith("after ready")][:10]:
            print(f"      {s}", flush=True)
        # after every child: a command stopped by its time limit keeps what finished
        (out_dir / "first_request_stall.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
