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
    # None: the model's recommended value (its generation_config.json, unless --generation-config vllm),
    # else this command's own (CLI_SAMPLING)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens generated (default: the model's max_new_tokens, else 64)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0 is greedy (default: the model's recommended one, else 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling: keep this share of the probability (default: the model's, else 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help="keep the k likeliest tokens; 0 keeps all (default: the model's, else 0)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: none, a random one); see README, Seeds: what is reproducible")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, repeatable (default: none; generation stops at EOS)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print the output as JSON")
    add_engine_args(p)
    p.set_defaults(func=run)


# this command's own sampling defaults, where neither the user nor the model's generation_config says
CLI_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 64}


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

    llm = LLM(args.model, skip_tokenizer_init=args.skip_tokenizer_init, **engine_kwargs(args))
    given = {k: getattr(args, k) for k in CLI_SAMPLING if getattr(args, k) is not None}
    sampling = {**CLI_SAMPLING, **llm.llm_engine.sampling_defaults, **given}
    params = SamplingParams(**{k: sampling[k] for k in CLI_SAMPLING}, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    prompt = args.prompt if args.prompt is not None else args.prompt_token_ids
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    c = out.outputs[0]
    if args.json:
        print(json.dumps({"prompt": args.prompt, "prompt_token_ids": out.prompt_token_ids, "text": c.text,
                          "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
    elif args.prompt is None:  # token ids in, token ids out
        print(json.dumps(c.token_ids))
    else:
        print(args.prompt + c.text)
    return 0
