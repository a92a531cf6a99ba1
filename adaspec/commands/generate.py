"""Generate a completion for one prompt with the offline engine and print it.

The engine flags are the same as adaspec serve's (vLLM's names); with --speculative-config the
completion is drafted by a DSpark drafter and verified by the target (the output distribution
does not change).
"""
from __future__ import annotations

import argparse
import json

from adaspec.commands.options import ENGINE_OPTIONS, add_engine_args, add_option, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt (offline)", description=__doc__)
    add_option(p, ENGINE_OPTIONS["model"])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-token-ids", type=_token_ids, metavar="IDS",
                     help="the prompt as token ids, e.g. '[1, 2, 3]' or '1,2,3'")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: the prompt must be --prompt-token-ids, the output is token ids")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens generated")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this share of the probability")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 keeps all")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: none, a random one); see README, Seeds: what is reproducible")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, repeatable (default: none; generation stops at EOS)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print the output as JSON")
    add_engine_args(p)
    p.set_defaults(func=run)


def _token_ids(text: str) -> list[int]:
    try:
        ids = json.loads(text) if text.strip().startswith("[") else [int(t) for t in text.split(",")]
    except ValueError:
        ids = None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise argparse.ArgumentTypeError(f"not a list of token ids: {text!r} (use e.g. '[1, 2, 3]' or '1,2,3')")
    return ids


def run(args) -> int:
    from adaspec import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, skip_tokenizer_init=args.skip_tokenizer_init, **engine_kwargs(args))
    prompt = args.prompt if args.prompt is not None else args.prompt_token_ids
    out = llm.generate([prompt], params)[0]
    c = out.outputs[0]
    if args.json:
        print(json.dumps({"prompt": args.prompt, "prompt_token_ids": out.prompt_token_ids, "text": c.text,
                          "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
    elif args.prompt is None:  # token ids in, token ids out
        print(json.dumps(c.token_ids))
    else:
        print(args.prompt + c.text)
    return 0
