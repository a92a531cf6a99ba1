"""GPU probe: what each kind of engine step really costs in a closed loop, per arm: the wall time of
every engine.step() call, classified as a drafting step (after a drafting step, or right after a
plain one: a probe or a switch), or a plain step, with or without prefill rows. The Qwen3-0.6B
shape with the pair's vocabulary (16384), random weights, synthetic acceptance (timing only),
greedy, 64 output tokens. For the measured policy's arm its measured step costs are printed too
(tokens per request per ms per kind and bucket since ceabd37; wall / priced ratios before). Writes $OUT/step_kinds_trace.json.

    python3 benchmarks/probes/step_kinds_trace.py [--concurrency 16] [--arms fixed:7,adaptive-measured:7]
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec import LLM, SamplingParams  # noqa: E402
from offline_sweep import arm_config, policy_step_costs, shape_model_dir  # noqa: E402

CURVE = [0.7368, 0.6615, 0.6646, 0.6760, 0.7110, 0.7364, 0.7361]  # run 10's pair, held-out T = 0


def trace(arm, c, model_dir, num_prompts):
    llm = LLM(model_dir, load_format="dummy", max_num_seqs=c, skip_tokenizer_init=True, max_model_len=2048,
              speculative_config=arm_config(arm, None, 0.0, {"synthetic_acceptance": CURVE,
                                                            "synthetic_confidence_noise": 0.05}))
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    vocab = eng.model_config.vocab_size
    prompts = [torch.randint(1, min(10000, vocab), (int(n),), generator=g).tolist() for n in torch.randint(32, 256, (num_prompts,),
                                                                                                  generator=g)]
    for rnd in range(2):  # the first round warms up (kernels, the policy's measurements)
        for i, p in enumerate(prompts):
            eng.add_request(f"{rnd}-{i}", p, params)
        steps, prev_drafted = [], None
        while eng.has_unfinished_requests():
            st = eng.stats
            d0, p0, g0 = st.num_draft_tokens, st.num_prompt_tokens, st.num_generated_tokens
            running = eng.num_running()
            t0 = time.perf_counter()
            eng.step()
            dt = 1e3 * (time.perf_counter() - t0)
            drafted = st.num_draft_tokens > d0
            kind = ("draft after plain" if prev_drafted is False else "draft") if drafted else "plain"
            steps.append({"kind": kind, "prefill": st.num_prompt_tokens > p0, "ms": dt, "running": running,
                          "tokens": st.num_generated_tokens - g0})
            prev_drafted = drafted
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    summary = {}
    for kind in ("draft", "draft after plain", "plain"):
        for prefill in (False, True):
            xs = [s for s in steps if s["kind"] == kind and s["prefill"] == prefill]
            if xs:
                summary[f"{kind}{' +prefill' if prefill else ''}"] = {
                    "steps": len(xs), "median_ms": round(statistics.median(s["ms"] for s in xs), 3),
                    "mean_ms": round(statistics.fmean(s["ms"] for s in xs), 3),
                    "tokens_per_step": round(statistics.fmean(s["tokens"] for s in xs), 1)}
    total_ms = sum(s["ms"] for s in steps)
    out = {"arm": arm, "concurrency": c, "steps": len(steps), "tokens_per_s": round(
        1e3 * sum(s["tokens"] for s in steps) / total_ms), "by_kind": summary, "policy_step_costs": policy_step_costs(eng)}
    del llm, eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--arms", default="none,fixed:7,adaptive:7,adaptive-measured:7")
    ap.add_argument("--num-prompts", type=int, default=0, help="default 4 x concurrency")
    ap.add_argument("--shape-overrides", default='{"vocab_size": 16384}', help="e.g. fewer layers for a CPU smoke test")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = shape_model_dir("qwen3-0.6b", args.shape_overrides)
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        for arm in args.arms.split(","):
            r = trace(arm, c, model_dir, args.num_prompts or 4 * c)
            results.append(r)
            print(f"{arm} C={c}: {r['tokens_per_s']} tok/s over {r['steps']} steps (timed steps only)", flush=True)
            for k, v in r["by_kind"].items():
                print(f"    {k:<24} {v['steps']:4d} steps  median {v['median_ms']:7.3f} ms  mean {v['mean_ms']:7.3f} ms"
                      f"  {v['tokens_per_step']:6.1f} tokens/step", flush=True)
            if r["policy_step_costs"]:
                print(f"    measured step costs: {r['policy_step_costs']}", flush=True)
    (out_dir / "step_kinds_trace.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
