"""Why every live request's matcher is a compile of its own (sample/structured_outputs.py,
MatcherPool): llguidance's copies of one matcher (LLMatcher.deep_copy) share its lexer behind a
lock that a mask's computation holds, so the executor's threads cannot compute their masks at once.

For N matchers of one regex at their own points of an output, the mask step's time (one
LLExecutor call for all N) with 1 and T threads: N independent compiles against N copies of one.
The tokenizer is structured_mask_bench's random byte-level BPE vocabulary of the given size.

    python3 benchmarks/probes/llguidance_copies.py [--vocab 151936] [--requests 64] [--threads 2] [--steps 10]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parents[2]))

from structured_mask_bench import random_tokenizer  # noqa: E402

from adaspec.sample import structured_outputs as so  # noqa: E402


def mask_step_ms(executor, matchers, words: int, steps: int) -> float:
    """Mean ms of one mask call for all matchers; between calls each consumes an allowed token."""
    bits = torch.zeros(len(matchers), words, dtype=torch.int32)
    total = 0.0
    for s in range(steps):
        t0 = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), words * 4,
                                         len(matchers))
        total += time.perf_counter() - t0
        for i, m in enumerate(matchers):  # each its own allowed token: the matchers drift apart
            w = int(torch.nonzero(bits[i]).flatten()[(s * 7 + i) % 5])
            word = int(bits[i, w]) & 0xFFFFFFFF
            if not m.consume_token(w * 32 + (word & -word).bit_length() - 1):
                raise RuntimeError(m.get_error())
    return 1e3 * total / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    ll = so._llguidance()
    ll_tok = so.grammar_tokenizer(random_tokenizer(a.vocab), a.vocab, [0])
    text = ll.LLMatcher.grammar_from_regex("[a-z ,.]{4000}")
    words = (a.vocab + 31) // 32
    print(f"vocabulary {a.vocab}, {a.requests} matchers of one regex, {os.cpu_count()} CPUs, {a.steps} steps")
    print(f"{'threads':>7} {'own compiles ms/step':>21} {'copies of one ms/step':>22}")
    for threads in sorted({1, a.threads}):
        executor = ll.LLExecutor(num_threads=threads)
        own = [ll.LLMatcher(ll_tok, text, log_level=0) for _ in range(a.requests)]
        template = ll.LLMatcher(ll_tok, text, log_level=0)
        copies = [template.deep_copy() for _ in range(a.requests)]
        print(f"{threads:>7} {mask_step_ms(executor, own, words, a.steps):>21.2f} "
              f"{mask_step_ms(executor, copies, words, a.steps):>22.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
