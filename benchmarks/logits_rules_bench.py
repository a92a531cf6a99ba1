"""What logits rules cost (sample/logits_rules.py): offline output throughput of the same requests
with and without a rule (penalties, logit_bias, min_tokens), and with structured outputs (a regex
that never ends within max_tokens, so every request makes as many tokens: sample/structured_outputs.py),
per arm, in one process, repeats interleaved so that a drift of the machine's speed moves all alike.

    python3 benchmarks/logits_rules_bench.py [--model tiny] [--arms none,fixed:4,adaptive:7]
        [--variants plain,ruled,structured] [--requests 64] [--max-tokens 64] [--repeats 3]
        [--temperature 0] [--device auto] [--out FILE]

A rule is applied eagerly after the CUDA graphs: the plain engine samples ruled rows outside its
sampling graphs; the speculative step's graphs serve them and redo their verification after the
replay, in steps that are not pipelined and wait for the drafts (spec_decode/graphed_extras.py),
and there the drafter proposes without the rule (its additive part guides it in the eager step
only), so the ruled arm pays the redo and maybe some acceptance; on a CPU, where every step is
eager, it pays the rule's own work. Structured outputs also read every step back before the next
is scheduled (no async overlap) and compute the grammar's masks on the host. Prints the median
output tokens/s per (arm, variant) with the spread over repeats, the ratio to plain, and the
acceptance of the speculative arms.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from adaspec import LLM, SamplingParams
from adaspec.sampling_params import StructuredOutputsParams
from adaspec.bench.conditions import engine_commit, hardware, now_iso

RULE = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={11: 1.0}, min_tokens=8)
STRUCTURED_REGEX = "[a-z ,.]{4000}"  # letters and spaces that cannot end before max_tokens


def speculative_config(arm: str) -> dict | None:
    if arm == "none":
        return None
    kind, k = arm.split(":")
    return {"method": "dspark", "num_speculative_tokens": int(k), "enable_adaptive_verification": kind == "adaptive"}


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (int(L),), generator=g).tolist() for L in torch.randint(16, 96, (n,), generator=g)]


def run_once(llm: LLM, batch: list[list[int]], params: SamplingParams) -> dict:
    eng = llm.llm_engine
    before = (eng.stats.num_accepted_tokens, eng.stats.num_draft_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    accepted, drafted = eng.stats.num_accepted_tokens - before[0], eng.stats.num_draft_tokens - before[1]
    return dict(tokens=tokens, seconds=dt, tok_s=tokens / dt, acceptance=accepted / drafted if drafted else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--arms", default="none,fixed:4,adaptive:7")
    ap.add_argument("--variants", default="plain,ruled,structured")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for arm in args.arms.split(","):
        llm = LLM(args.model, speculative_config=speculative_config(arm), device=args.device,
                  max_num_seqs=args.requests)
        batch = prompts(args.requests, llm.llm_engine.model_config.vocab_size)
        base = dict(temperature=args.temperature, seed=1, max_tokens=args.max_tokens)
        made = {"plain": lambda: SamplingParams(**base, ignore_eos=True),
                "ruled": lambda: SamplingParams(**base, ignore_eos=True, **RULE),
                "structured": lambda: SamplingParams(**base, structured_outputs=StructuredOutputsParams(
                    regex=STRUCTURED_REGEX))}
        variants = {name: made[name]() for name in ["plain"] + [v for v in args.variants.split(",") if v != "plain"]}
        for params in variants.values():  # first-use work (compiles, caches) outside the timing
            run_once(llm, batch[:4], params)
        runs = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, params in variants.items():
                runs[name].append(run_once(llm, batch, params))
        for name, rs in runs.items():
            rates = [r["tok_s"] for r in rs]
            results.append(dict(arm=arm, rule=name, tokens=[r["tokens"] for r in rs], tok_s_median=statistics.median(rates),
                                tok_s_std=statistics.stdev(rates) if len(rates) > 1 else 0.0,
                                acceptance=rs[-1]["acceptance"], repeats=rs))
        del llm
    print(f"{'arm':<12} {'variant':<10} {'tok/s (median)':>15} {'+/- std':>9} {'/ plain':>8} {'acceptance':>11}")
    for r in results:
        plain = next(p for p in results if p["arm"] == r["arm"] and p["rule"] == "plain")
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        print(f"{r['arm']:<12} {r['rule']:<10} {r['tok_s_median']:>15.1f} {r['tok_s_std']:>9.1f} "
              f"{r['tok_s_median'] / plain['tok_s_median']:>8.3f} {acc:>11}")
    if args.out:
        # the conditions first: opening the file truncates it, and a tracked one would mark the commit dirty
        conditions = dict(vars(args), rule=RULE, structured_regex=STRUCTURED_REGEX, hardware=hardware(), torch=torch.__version__,
                          engine_commit=engine_commit(), date=now_iso())
        with open(args.out, "w") as f:
            json.dump(dict(conditions=conditions, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
