"""`adaspec eval drafter`: offline drafter acceptance without the serving engine.

The target continues each prompt, then every anchor of the continuation is scored
teacher-forced (adaspec/train/drafter_eval.py says exactly how). Prints a per-slot table
per temperature and writes the figures as JSON (--json).
"""
from __future__ import annotations

import json
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="offline evaluations (drafter acceptance)")
    sub = p.add_subparsers(dest="eval_command", metavar="WHAT")
    d = sub.add_parser("drafter", help="per-slot acceptance, tau and confidence calibration of a drafter")
    d.add_argument("--target", required=True)
    d.add_argument("--drafter", required=True)
    d.add_argument("--prompts", default="eval-code", help="'eval-code', a .jsonl file or a .npy of token ids")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--max-prompt-len", type=int, default=512)
    d.add_argument("--temperature", type=float, action="append", help="repeatable; default 0 and 1")
    d.add_argument("--k", type=int, default=None, help="slots evaluated (default: the drafter's block size)")
    d.add_argument("--gen-len", type=int, default=128)
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--device", default="auto")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", type=Path, help="write the results here")
    d.set_defaults(func=run_drafter)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_drafter(args) -> int:
    import torch

    from adaspec.errors import AdaspecError
    from adaspec.models.drafter import load_drafter
    from adaspec.models.loader import load_target, model_dir
    from adaspec.models.tokenizer import Tokenizer
    from adaspec.train.drafter_eval import format_table, generate_eval_set, load_prompts, measure_blocks, summarize

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    target, tcfg = load_target(args.target, dtype=dtype, device=device)
    drafter, dcfg = load_drafter(args.drafter, target_cfg=tcfg, dtype=dtype, device=device)
    if args.k is not None and not 1 <= args.k <= dcfg.block_size:
        raise AdaspecError(f"--k must be in 1..{dcfg.block_size} (the drafter's block size)")
    tok = Tokenizer.from_dir(model_dir(args.target))
    prompts = load_prompts(args.prompts, tok, args.num_prompts, args.max_prompt_len)
    results = {"target": str(args.target), "drafter": str(args.drafter), "prompts": args.prompts,
               "num_prompts": len(prompts), "gen_len": args.gen_len, "runs": []}
    for t in args.temperature or [0.0, 1.0]:
        # the set propose() would apply to a request at this temperature
        temps = (dcfg.confidence_temperatures_greedy if t <= 0 else None) or dcfg.confidence_temperatures
        seqs, starts = generate_eval_set(target, prompts, args.gen_len, t, seed=args.seed)
        res = measure_blocks(target, drafter, seqs, starts, t, k=args.k, batch_size=args.batch_size, seed=args.seed)
        s = summarize(res, temps[: res.alpha.shape[1]] if temps else None)
        print(format_table(s), flush=True)
        results["runs"].append(s)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0
