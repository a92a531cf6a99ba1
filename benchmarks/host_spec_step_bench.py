"""The host's work per speculative decode step, without a GPU: `LLMEngine.step()` of the tiny
pair with the graphed speculative step (spec_decode/graphed_step.py) whose two replays and read
back are replaced by a stub that returns plausible results at once (k + 1 tokens, 0-4 accepted
drafts per request, confidences 0.7), so what is timed is everything the host does around the
graphs: scheduling, the policy's budget, the graphs' inputs, the read back's bookkeeping, the
stop checks and detokenization, and the outputs. On the H200 this host work sits between the
graphs of every step (the speculative step has no async scheduling), ~2.9 ms of a 14 ms step
at 256 requests of the 0.6B shape (BENCHMARKS.md, run 8).

    python3 benchmarks/host_spec_step_bench.py [--batch 256] [--steps 100] [--repeats 3]
        [--output-kind final_only|cumulative|new_tokens] [--adaptive] [--no-detokenize]
        [--gc as-is|freeze] [--accepted 0..4] [--out FILE]

final_only is what LLM.generate and benchmarks/offline_sweep.py ask for; new_tokens, the server's
engine process (cumulative before it, and the server's engine thread). --gc freeze freezes the
collector after each build, as the offline sweep and `adaspec serve` do: unfrozen, full collections
walk the ~300k objects of a process that imported torch and take about half a profiled step.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch

from adaspec import LLM, RequestOutputKind, SamplingParams
from adaspec.spec_decode.graphed_step import GraphedSpecStep


def build(args):
    k = 7
    cfg = {"method": "dspark", "num_speculative_tokens": k, "enable_adaptive_verification": args.adaptive}
    eng = LLM("tiny", device="cpu", max_num_seqs=args.batch, max_model_len=2048, speculative_config=cfg,
              num_kv_blocks=max(64 * args.batch, 160)).llm_engine  # 160: one max_model_len request
    g = GraphedSpecStep(eng.spec, eng, batch_sizes=sorted({1, 8, 64, args.batch}))
    g.capture(eager=True)
    eng.spec.use_graphs(g)
    kind = RequestOutputKind[args.output_kind.upper()]
    for i in range(args.batch):
        eng.add_request(str(i), list(range(5, 37)), SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True,
                                                                    output_kind=kind, detokenize=args.detokenize))
    eng.step()  # the real prefill (the eager step)
    rng = np.random.default_rng(0)
    state = {}

    def launch(key, last_tok, start, slots, seeds, temperature, block_tables, drafting, budget, carried=None,
               first_tokens=None, draft_width=None, extras=None):  # synchronous on the CPU: nothing carried;
        # greedy requests without logprobs or top-k / top-p: no extras rows
        n = len(last_tok)
        rb = np.zeros((n, 2 * k + 3), dtype=np.int64)
        rb[:, : k + 1] = rng.integers(10, 300, (n, k + 1))
        accepted = rng.integers(0, 5, n) if args.accepted is None else np.full(n, args.accepted)
        rb[:, k + 1] = accepted if drafting else 0
        rb[:, k + 2] = np.where(np.asarray(slots) > 0, 5, 1)
        rb[:, k + 3:] = np.full((n, k), 0.7, dtype=np.float32).view(np.int32)
        state["rb"] = rb

    def read_back():
        g.num_read_backs += 1
        return state.pop("rb"), None  # (read back, the extras rows' logprobs)

    g.launch, g.read_back = launch, read_back
    for _ in range(3):
        eng.step()
    if not all(s.is_decoding for s in eng.scheduler.running):
        raise SystemExit("not every request decodes: the timed steps would not be decode steps")
    return eng


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-kind", choices=("final_only", "cumulative", "new_tokens"), default="final_only")
    ap.add_argument("--adaptive", action="store_true", help="the adaptive policy (its cost tables are profiled first)")
    ap.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-detokenize: the engine makes no text (what `adaspec serve --api-detokenize` asks of it)")
    ap.add_argument("--gc", choices=("as-is", "freeze"), default="as-is",
                    help="freeze: gc.freeze() after each build, as the sweep and `adaspec serve` do")
    ap.add_argument("--accepted", type=int, default=None, choices=range(0, 5), metavar="0..4",
                    help="drafts every request accepts a step, of the 4 the stub verifies (default: 0-4 at random): "
                         "how the host's work grows with the tokens a step emits")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = []
    for _ in range(args.repeats):
        eng = build(args)
        if args.gc == "freeze":
            gc.collect()
            gc.freeze()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        runs.append((time.perf_counter() - t0) / args.steps * 1e3)
        accepted_length = eng.stats.mean_accepted_length  # tokens a drafting request gained a step (the stub's)
        gc.unfreeze()
    med = statistics.median(runs)
    print(f"batch {args.batch}, {args.output_kind} outputs{'' if args.detokenize else ' without text'}, "
          f"{'adaptive' if args.adaptive else 'fixed'}:7, gc {args.gc}, accepted {'0-4' if args.accepted is None else args.accepted}: host step {med:.2f} ms (runs {', '.join(f'{r:.2f}' for r in runs)})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(args=vars(args), torch=torch.__version__, runs_ms=runs, median_ms=med,
                           mean_accepted_length=accepted_length), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
