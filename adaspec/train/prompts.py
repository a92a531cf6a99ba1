"""Evaluation prompt sets: code prefixes cut from a corpus's TEST split, and loading them by name.

`adaspec train prompts` cuts ``--num`` prefixes from the test split: each starts at an
unindented line of a test file, ends at a line boundary (so the model continues with a new
line) with text left after it in the file, and has a token length drawn log-uniformly from
[--min-tokens, --max-tokens]. The output is jsonl in the ``vllm bench serve`` custom format
(one ``{"prompt": ...}`` per line), plus ``NAME.meta.json`` recording how it was made.

Shipped sets live in ``adaspec/assets/prompts/`` and are loaded by name: ``eval-code``.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

from adaspec.errors import AdaspecError

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "assets" / "prompts"


def available_prompt_sets() -> list[str]:
    return sorted(p.name[: -len(".jsonl")] for p in PROMPTS_DIR.glob("*.jsonl")) if PROMPTS_DIR.is_dir() else []


def resolve_prompt_set(name_or_path: str | Path) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = PROMPTS_DIR / f"{name_or_path}.jsonl"
    if shipped.is_file():
        return shipped
    raise AdaspecError(
        f"prompt set {str(name_or_path)!r} not found: give a jsonl file with a 'prompt' field, "
        f"or one of {', '.join(available_prompt_sets()) or '(none shipped)'}"
    )


def load_prompt_set(name_or_path: str | Path) -> list[str]:
    """Prompts of a shipped set (by name, e.g. ``eval-code``) or of a jsonl file with a "prompt" field."""
    from adaspec.bench.dataset import read_jsonl_prompts

    return read_jsonl_prompts(resolve_prompt_set(name_or_path))


def _cut(lines: list[str], start: int, target: int, max_tokens: int, count) -> str | None:
    """Lines from ``start`` until about ``target`` tokens, never past ``max_tokens``, never to EOF."""
    text, n = "", 0
    for j in range(start, len(lines) - 1):  # leave at least one line to continue with
        nxt = text + lines[j]
        n = count(nxt) if n + 40 >= target else n + count(lines[j])
        if n > max_tokens:
            break
        text = nxt
        if n >= target:
            return text
    return None


def build_prompts(corpus: Path, tokenizer_dir: Path, num: int = 500, min_tokens: int = 64,
                  max_tokens: int = 512, seed: int = 0) -> list[str]:
    from adaspec.train.corpus import iter_split
    from adaspec.train.tokenizer import load_raw

    tok = load_raw(tokenizer_dir)

    def count(s: str) -> int:
        return len(tok.encode(s, add_special_tokens=False).ids)

    docs = [r["text"].splitlines(keepends=True) for r in iter_split(corpus, "test")]
    docs = [d for d in docs if len(d) > 2]
    if not docs:
        raise AdaspecError(f"{corpus}: the test split has no usable documents")
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(prompts) < num and attempts < num * 50:
        attempts += 1
        lines = docs[attempts % len(docs)] if attempts <= len(docs) else rng.choice(docs)
        starts = [i for i, ln in enumerate(lines[:-1]) if ln[:1] not in ("", " ", "\t", "\n", "\r", "#")]
        if not starts:
            continue
        target = round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens))))
        text = _cut(lines, rng.choice(starts), target, max_tokens, count)
        if text is None or text in seen or not (min_tokens <= count(text) <= max_tokens):
            continue
        seen.add(text)
        prompts.append(text)
    if len(prompts) < num:
        raise AdaspecError(f"only {len(prompts)} of {num} prompts could be cut from the test split")
    return prompts


def write_prompt_set(prompts: list[str], out: Path, meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}, ensure_ascii=False) + "\n")
    meta_path = out.with_name(out.name[: -len(".jsonl")] + ".meta.json") if out.name.endswith(".jsonl") else None
    if meta_path is not None:
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def add_subparser(sub) -> None:
    p = sub.add_parser("prompts", help="cut an evaluation prompt set from a corpus's test split", description=__doc__)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="output .jsonl")
    p.add_argument("--num", type=int, default=500)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args) -> int:
    import statistics
    import sys

    from adaspec.train.data import tokenizer_sha
    from adaspec.train.tokenizer import load_raw

    prompts = build_prompts(args.corpus, args.tokenizer, args.num, args.min_tokens, args.max_tokens, args.seed)
    tok = load_raw(args.tokenizer)
    lens = sorted(len(tok.encode(p, add_special_tokens=False).ids) for p in prompts)
    stats_path = Path(args.corpus) / "stats.json"
    corpus = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    meta = {
        "command": "adaspec " + " ".join(sys.argv[1:]),
        "source_split": "test",
        "corpus_python_version": corpus.get("python_version"),
        "corpus_split_rule": corpus.get("split_rule"),
        "test_files": corpus.get("splits", {}).get("test", {}).get("files"),
        "tokenizer_sha256": tokenizer_sha(args.tokenizer),
        "num_prompts": len(prompts),
        "prompt_tokens": {"min": lens[0], "median": statistics.median(lens), "mean": round(sum(lens) / len(lens), 1),
                          "max": lens[-1]},
        "seed": args.seed,
        "format": "vllm bench serve custom: one {\"prompt\": ...} per line",
    }
    write_prompt_set(prompts, args.out, meta)
    print(f"{len(prompts)} prompts, {lens[0]}-{lens[-1]} tokens (median {meta['prompt_tokens']['median']}) -> {args.out}")
    return 0
