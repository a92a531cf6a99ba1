"""What the penalties cost one call of `apply_logits_rules` (sample/logits_rules.py) on verification
rows, with the penalties applied to the histories' tokens only (the CPU's path) and to every logit
(the dense ops CUDA runs), alternated in one process on the same inputs: R requests x (k + 1)
verification positions, each position its request's history plus the drafts before it.

    python3 benchmarks/penalties_bench.py [--requests 64] [--positions 5] [--vocab 8192]
        [--prompt-len 40] [--output-len 30] [--calls 30] [--rounds 3] [--device cpu]

Prints the mean ms per call of each path, round by round, and checks that both give the same floats.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from adaspec.sample import logits_rules
from adaspec.sample.logits_rules import LogitsRule, RuleRow, apply_logits_rules
from adaspec.sampling_params import SamplingParams


class History:
    """A request's history object, as an engine Sequence is one (its counts are kept between calls)."""

    logits_rule_state = None


def make_rows(args) -> list[RuleRow]:
    rng = random.Random(0)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={11: 1.0},
                       min_tokens=8)
    rule = LogitsRule.of(p, [0], args.vocab)
    rows = []
    for _ in range(args.requests):
        hist = History()
        prompt = [rng.randrange(args.vocab) for _ in range(args.prompt_len)]
        output = [rng.randrange(args.vocab) for _ in range(args.output_len)]
        drafts = [rng.randrange(args.vocab) for _ in range(args.positions - 1)]
        rows += [RuleRow(rule, 0.0, prompt, output, drafts[:j], history=hist) for j in range(args.positions)]
    return rows


def result(rows, logits, sparse: bool) -> torch.Tensor:
    logits_rules._sparse_penalties = lambda device: sparse
    return apply_logits_rules(logits, rows)


def timed(rows, logits, sparse: bool, calls: int) -> float:
    result(rows, logits, sparse)  # warm-up
    t = time.perf_counter()
    for _ in range(calls):
        apply_logits_rules(logits, rows)
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--positions", type=int, default=5, help="verification positions per request (k + 1)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--output-len", type=int, default=30)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rows = make_rows(args)
    logits = torch.randn(len(rows), args.vocab, generator=torch.Generator().manual_seed(0)).to(args.device)
    chosen = logits_rules._sparse_penalties
    try:
        same = torch.equal(result(rows, logits, True), result(rows, logits, False))
        ms = {True: [], False: []}
        for _ in range(args.rounds):
            for sparse in (False, True):
                ms[sparse].append(timed(rows, logits, sparse, args.calls))
    finally:
        logits_rules._sparse_penalties = chosen
    print(f"{len(rows)} rows ({args.requests} requests x {args.positions} positions), V = {args.vocab}, "
          f"{args.device}, {torch.get_num_threads()} threads; ms per call, mean of {args.calls} calls, round by round")
    for sparse, name in ((False, "dense (every logit)"), (True, "sparse (the histories' tokens)")):
        runs = ms[sparse]
        print(f"  {name:<32} {' '.join(f'{m:7.2f}' for m in runs)}   median {statistics.median(runs):.2f}")
    print(f"same floats both ways: {same}")


if __name__ == "__main__":
    main()
