"""Where do the graphed and the eager speculative steps part ways? A diagnostic, not a benchmark.

Runs the tiny pair (float32, fixed k, seeded sampling at T = 1) in an eager engine and in a graphed
one, in lockstep over the same requests (adaspec/spec_decode/lockstep.py), for several prompt/seed
sets, and prints every request whose tokens differ with the decision that parted the two engines
and its margin: a near-tie (margin under 1e-4, float32 rounding) or a logic difference. On CPU the
graphed functions run eagerly over the same static buffers (capture(eager=True)).

    python3 benchmarks/graph_divergence_check.py [--requests 19] [--sets 4] [--k 5] [--device cuda] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

from adaspec import LLM, SamplingParams
from adaspec.spec_decode.lockstep import NEAR_TIE, run_lockstep


def prompts(n: int, seed: int, vocab: int = 8000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(L),), generator=g).tolist() for L in torch.randint(5, 60, (n,), generator=g)]


def engine(graphed: bool, device: str, k: int, draft_sample_method: str = "probabilistic"):
    cfg = {"method": "dspark", "num_speculative_tokens": k, "draft_sample_method": draft_sample_method}
    # synchronous steps: the lockstep compares the two engines step by step (a pipelined engine
    # returns each step's tokens one call later)
    eng = LLM("tiny", speculative_config=cfg, enforce_eager=not graphed, max_num_seqs=24, device=device,
              dtype="float32", async_scheduling=False).llm_engine
    if graphed and eng.spec.graphed is None:  # CPU: the graphed functions run eagerly on static buffers
        from adaspec.spec_decode.graphed_step import GraphedSpecStep

        g = GraphedSpecStep(eng.spec, eng, batch_sizes=[1, 2, 4, 8, 16, 24])
        g.capture(eager=True)
        eng.spec.use_graphs(g)
    return eng


def requests(n: int, seed: int, temperature: float = 1.0):
    return [(f"{i:03d}", p, SamplingParams(temperature=temperature, max_tokens=8 + 5 * (i % 7), ignore_eos=True,
                                           seed=seed * 1000 + i))
            for i, p in enumerate(prompts(n, seed))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=19)
    ap.add_argument("--sets", type=int, default=4, help="prompt/seed sets to run")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows, compared, unexplained = [], 0, 0
    for s in range(args.sets):
        found, n = run_lockstep(engine(False, args.device, args.k), engine(True, args.device, args.k),
                                requests(args.requests, 19 + s))
        compared += n
        print(f"set {s}: {len(found)} of {n} requests differ")
        for d in found:
            unexplained += not d.explained()
            print(f"  request {d.request_id} step {d.step} token {d.index}: eager {d.eager_tokens} graphed "
                  f"{d.graphed_tokens}; parted at {d.decision}, margin {d.margin:.2e} -> "
                  f"{'near-tie' if d.explained() else 'NOT a near-tie'}")
            rows.append(dict(set=s, **asdict(d)))
    print(f"{len(rows)} of {compared} requests differ; {unexplained} not explained by a near-tie (tol {NEAR_TIE})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=args.device, k=args.k, requests=compared, divergences=rows,
                           unexplained=unexplained, tol=NEAR_TIE), fh, indent=1)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
