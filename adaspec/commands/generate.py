"""`adaspec generate MODEL --prompt TEXT`: one offline generation, printed."""
from __future__ import annotations

import argparse
import json


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by generate / profile (vLLM's names)."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "varlen"])
    p.add_argument("--speculative-config", default=None, help='JSON, e.g. \'{"method": "dspark", "num_speculative_tokens": 7}\'')


def engine_kwargs(args) -> dict:
    return dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory, attention_backend=args.attention_backend,
        speculative_config=args.speculative_config,
    )


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt (offline)")
    p.add_argument("model", help="model directory or embedded name (tiny)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-token-ids", type=_token_ids, metavar="IDS",
                     help="the prompt as token ids, e.g. '[1, 2, 3]' or '1,2,3'")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: the prompt must be --prompt-token-ids, the output is token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
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
