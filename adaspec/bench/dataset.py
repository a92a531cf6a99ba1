"""Prompt sets: the packaged eval-code set, a user's jsonl (`custom`, vLLM's name, is the same), or
seeded random prompts of exactly --random-input-len tokens of the model's tokenizer (as vLLM's
`random` dataset: random token ids, decoded)."""
from __future__ import annotations

import json
import random
from pathlib import Path

from adaspec.errors import AdaspecError

class DatasetError(AdaspecError):
    """A prompt set that cannot be read."""


def eval_code_path() -> Path:
    # Resolved next to the package, so an installed wheel finds its own copy.
    return Path(__file__).resolve().parent.parent / "assets" / "prompts" / "eval-code.jsonl"


def read_jsonl_prompts(path: str | Path) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"prompt file not found: {p}")
    prompts: list[str] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise DatasetError(f"{p}:{lineno}: each line needs a string field \"prompt\"")
            prompts.append(row["prompt"])
    if not prompts:
        raise DatasetError(f"{p}: no prompts in file")
    return prompts


def tokenizer_dir(name: str | None) -> Path | None:
    """The directory holding tokenizer.json for a model name (embedded, e.g. `tiny`) or directory."""
    if not name:
        return None
    from adaspec.models.registry import resolve_model_path

    d = resolve_model_path(name)
    return d if (d / "tokenizer.json").is_file() else None


def _word_tokens(tok) -> list[str]:
    """Tokens that are one space and letters and encode back to themselves: joined, they tokenize
    as the same tokens (BPE keeps a word after a space whole), so the length in tokens is exact."""
    words, chars = [], []
    for i in range(tok.get_vocab_size(with_added_tokens=False)):
        w = tok.decode([i])
        if not w.isascii() or tok.encode(w, add_special_tokens=False).ids != [i]:
            continue
        if len(w) > 2 and w[0] == " " and w[1:].isalpha():
            words.append(w)
        elif len(w) == 1 and w.isalpha():
            chars.append(w)
    # A byte-level tokenizer without merges (test micro models) has no word tokens: one letter is
    # one token there, and the joined length is checked below either way.
    return words if len(words) >= 20 else chars


def random_prompts(n: int, input_len: int, seed: int, tokenizer: str | None) -> list[str]:
    """n prompts of exactly input_len tokens of the tokenizer, drawn from its word tokens (seeded),
    special tokens included: a server adds the tokenizer's own to a text prompt (a Llama tokenizer's
    BOS, as vLLM does), so the words are that many fewer, as vLLM's random dataset sizes them."""
    from tokenizers import Tokenizer

    if input_len < 1:
        raise DatasetError(f"--random-input-len must be at least 1, got {input_len}")
    d = tokenizer_dir(tokenizer)
    if d is None:
        raise DatasetError(
            "--dataset random counts --random-input-len in tokens, so it needs the model's tokenizer: "
            f"give --tokenizer DIR (a directory with tokenizer.json){f'; {tokenizer!r} has none' if tokenizer else ''}")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    words = _word_tokens(tok)
    if len(words) < 10:
        raise DatasetError(f"the tokenizer in {d} has too few plain word tokens for random prompts")
    special = len(tok.encode(words[0], add_special_tokens=True).ids) - len(tok.encode(words[0], add_special_tokens=False).ids)
    if input_len <= special:
        raise DatasetError(f"--random-input-len {input_len} leaves no room beside the {special} special token(s) "
                           f"the tokenizer in {d} adds to a prompt")
    want = input_len - special
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        for _ in range(20):
            text = "".join(rng.choices(words, k=want))
            if len(tok.encode(text, add_special_tokens=False).ids) == want:
                break
        else:
            raise DatasetError(f"could not make a prompt of exactly {input_len} tokens with {d}")
        out.append(text)
    return out


def load_prompts(
    dataset: str, num_prompts: int, path: str | None = None, random_input_len: int = 64, seed: int = 0,
    tokenizer: str | None = None,
) -> list[str]:
    """Exactly `num_prompts` prompts, in file order, cycling when the set is smaller.

    File order (not a shuffle) keeps every arm of a sweep on the same prompts in the same order.
    """
    if num_prompts < 1:
        raise DatasetError(f"--num-prompts must be at least 1, got {num_prompts}")
    if dataset == "random":
        return random_prompts(num_prompts, random_input_len, seed, tokenizer)
    if dataset == "eval-code":
        p = eval_code_path()
        if not p.is_file():
            raise DatasetError(
                f"the packaged eval-code prompt set is missing ({p}); "
                "use --dataset jsonl --dataset-path FILE or --dataset random"
            )
        base = read_jsonl_prompts(p)
    elif dataset in ("jsonl", "custom"):
        if not path:
            raise DatasetError(f"--dataset {dataset} needs --dataset-path FILE (one {{\"prompt\": ...}} per line)")
        base = read_jsonl_prompts(path)
    else:
        raise DatasetError(f"unknown dataset {dataset!r}; use eval-code, jsonl (or custom) or random")
    return [base[i % len(base)] for i in range(num_prompts)]


def describe(dataset: str, path: str | None, random_input_len: int, seed: int, tokenizer: str | None = None) -> dict:
    """The prompt set as the manifest records it."""
    if dataset == "random":
        return {"dataset": "random", "random_input_len": random_input_len, "tokenizer": str(tokenizer_dir(tokenizer)),
                "seed": seed}
    if dataset == "eval-code":
        return {"dataset": "eval-code", "path": str(eval_code_path())}
    return {"dataset": dataset, "path": str(path)}
