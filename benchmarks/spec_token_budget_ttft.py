"""TTFT effect of reserving draft slots only for decoding requests (vLLM v0.28's "adaptive
speculative token budget") vs reserving max_num_seqs * k up front (`reserve_all_spec_slots`).

Offline engine, tiny + tiny-dspark, k = 7, max_num_seqs 64, max_num_batched_tokens 512: reserving
64 * 7 = 448 slots up front leaves 64 tokens per step for prefill. Requests arrive together with
the longest eval-code prompts; TTFT = first token time - arrival time, median over requests.

    python benchmarks/spec_token_budget_ttft.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from adaspec import LLM, SamplingParams
    from adaspec.train.prompts import load_prompt_set

    results = {}
    for reserve_all in (False, True):
        llm = LLM("tiny", max_num_seqs=64, max_num_batched_tokens=512, device="cpu",
                  speculative_config={"num_speculative_tokens": 7, "reserve_all_spec_slots": reserve_all})
        tok = llm.get_tokenizer()
        prompts = sorted((tok.encode(p) for p in load_prompt_set("eval-code")), key=len)[-args.requests * args.repeats:]
        eng = llm.llm_engine
        ttfts, steps = [], []
        for r in range(args.repeats):
            batch = prompts[r * args.requests:(r + 1) * args.requests]
            ids = [f"r{reserve_all}-{r}-{i}" for i in range(len(batch))]
            t0 = time.monotonic()
            for rid, p in zip(ids, batch):
                eng.add_request(rid, p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), arrival_time=t0)
            s0 = eng.stats.num_steps
            first = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.first_token_time is not None and o.request_id not in first:
                        first[o.request_id] = (o.first_token_time - t0, eng.stats.num_steps - s0)
            ttfts += [v[0] * 1e3 for v in first.values()]
            steps += [v[1] for v in first.values()]
        name = "reserve max_num_seqs*k up front" if reserve_all else "reserve for decoding requests only"
        results[name] = dict(median_ttft_ms=statistics.median(ttfts), ttft_ms=ttfts,
                             median_steps_to_first_token=statistics.median(steps),
                             prompt_tokens=[len(p) for p in prompts])
        print(f"{name:<40} median TTFT {statistics.median(ttfts):7.1f} ms  "
              f"(min {min(ttfts):.1f}, max {max(ttfts):.1f}; steps to first token {statistics.median(steps)})")
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
