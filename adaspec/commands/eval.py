"""Offline evaluations, without the serving engine.

eval drafter: the target continues each prompt, then every anchor of the continuation is
scored teacher-forced (adaspec/train/drafter_eval.py says exactly how). Prints a per-slot table
per temperature and writes the figures as JSON (--json).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from adaspec.commands.options import SHARED_OPTIONS, add_option, at_least
from adaspec.commands.writable import OutputPath

DRAFTER_DESCRIPTION = """\
Per-slot acceptance, tau and confidence calibration of a DSpark drafter, measured offline.

The target continues each prompt (--gen-len tokens at each --temperature); then every position
of the continuation is scored teacher-forced: the drafter proposes a block there and each slot's
acceptance probability against the target is recorded. Takes minutes on a CPU for the defaults.
"""


def status(message: str) -> None:
    """One line on stderr saying what a long step is doing (stdout keeps the results)."""
    print(f"adaspec: {message}", file=sys.stderr, flush=True)


def add_drafter_eval_args(p, num_prompts: int) -> None:
    """Options shared by `eval drafter` and `train calibrate` (same measurement)."""
    add_option(p, SHARED_OPTIONS["target"], required=True)
    add_option(p, SHARED_OPTIONS["drafter"], required=True)
    p.add_argument("--prompts", default="eval-code",
                   help="prompt set: eval-code (packaged), a .jsonl file with a prompt field, or a .npy of token ids")
    p.add_argument("--num-prompts", type=at_least(1), default=num_prompts, help="prompts used (at most)")
    p.add_argument("--skip-prompts", type=at_least(0), default=0,
                   help="leave out the set's first N prompts (e.g. calibrate on eval-code prompts the held-out "
                        "`eval drafter` run does not use)")
    p.add_argument("--max-prompt-len", type=at_least(1), default=512, help="prompt tokens kept (the last ones)")
    p.add_argument("--gen-len", type=at_least(1), default=128, help="tokens the target generates per prompt")
    p.add_argument("--batch-size", type=at_least(1), default=8, help="sequences per scoring batch")
    add_option(p, SHARED_OPTIONS["device"], default="auto")
    p.add_argument("--seed", type=int, default=0, help="seed of the target's sampling and the acceptance draws")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="offline evaluations (drafter acceptance)", description=__doc__)
    sub = p.add_subparsers(dest="eval_command", metavar="WHAT")
    d = sub.add_parser("drafter", help="per-slot acceptance, tau and confidence calibration of a drafter",
                       description=DRAFTER_DESCRIPTION)
    add_drafter_eval_args(d, num_prompts=100)
    d.add_argument("--temperature", type=at_least(0.0, float), action="append",
                   help="sampling temperature, repeatable (default: 0 and 1)")
    d.add_argument("--k", type=at_least(1), default=None, help="slots evaluated (default: the drafter's block size)")
    d.add_argument("--json", type=OutputPath(Path, "file"), help="write the results here (default: not written)")
    d.add_argument("--blocks-out", type=OutputPath(Path, "file"),
                   help="write every block decoding's walk reaches (calibrated confidences, accepted drafts) "
                        "to this .npz, for benchmarks/replay_policy.py --blocks (default: not written)")
    d.set_defaults(func=run_drafter)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def load_pair(args):
    """-> target, target config, drafter, drafter config, prompt token ids (saying so on stderr)."""
    import torch

    from adaspec.models.drafter import load_drafter
    from adaspec.models.loader import load_target, model_dir
    from adaspec.models.tokenizer import Tokenizer
    from adaspec.train.drafter_eval import load_prompts

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    status(f"loading target {args.target} and drafter {args.drafter} on {device} ({dtype})")
    t0 = time.perf_counter()
    target, tcfg = load_target(args.target, dtype=dtype, device=device)
    drafter, dcfg = load_drafter(args.drafter, target_cfg=tcfg, dtype=dtype, device=device)
    tok = Tokenizer.from_dir(model_dir(args.target))
    prompts = load_prompts(args.prompts, tok, args.num_prompts, args.max_prompt_len, skip=args.skip_prompts)
    status(f"loaded in {time.perf_counter() - t0:.1f} s")
    return target, tcfg, drafter, dcfg, prompts


def run_drafter(args) -> int:
    from adaspec.errors import AdaspecError
    from adaspec.train.drafter_eval import format_table, generate_eval_set, measure_blocks, save_blocks, summarize

    target, _, drafter, dcfg, prompts = load_pair(args)
    if args.k is not None and not 1 <= args.k <= dcfg.block_size:
        raise AdaspecError(f"--k must be in 1..{dcfg.block_size} (the drafter's block size)")
    results = {"target": str(args.target), "drafter": str(args.drafter), "prompts": args.prompts,
               "num_prompts": len(prompts), "gen_len": args.gen_len, "runs": []}
    blocks = []
    for t in args.temperature or [0.0, 1.0]:
        # the set propose() would apply to a request at this temperature
        temps = (dcfg.confidence_temperatures_greedy if t <= 0 else None) or dcfg.confidence_temperatures
        status(f"T={t:g}: the target generates {args.gen_len} tokens for each of {len(prompts)} prompts")
        t0 = time.perf_counter()
        seqs, starts = generate_eval_set(target, prompts, args.gen_len, t, seed=args.seed)
        status(f"T={t:g}: generated in {time.perf_counter() - t0:.1f} s; scoring the drafter's block at every "
               "generated position")
        t0 = time.perf_counter()
        res = measure_blocks(target, drafter, seqs, starts, t, k=args.k, batch_size=args.batch_size, seed=args.seed)
        status(f"T={t:g}: scored in {time.perf_counter() - t0:.1f} s")
        s = summarize(res, temps[: res.alpha.shape[1]] if temps else None)
        print(format_table(s), flush=True)
        results["runs"].append(s)
        blocks.append((res, temps[: res.alpha.shape[1]] if temps else None))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.blocks_out:
        args.blocks_out.parent.mkdir(parents=True, exist_ok=True)
        save_blocks(args.blocks_out, blocks)
    return 0
