"""Prompt sets: the packaged eval-code set, a user's jsonl, or seeded random word prompts."""
from __future__ import annotations

import json
import random
from pathlib import Path

from adaspec.errors import AdaspecError

# A fixed vocabulary so that `random` prompts are identical on every machine for one seed.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can out up into do any your what time about only other than then them these may its "
    "some could new first two like over such our made after also did many before must through "
    "years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came "
    "right used take three function return value list string number error class module import data"
).split()


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


def random_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(max(1, input_len))) for _ in range(n)]


def load_prompts(
    dataset: str, num_prompts: int, path: str | None = None, random_input_len: int = 64, seed: int = 0
) -> list[str]:
    """Exactly `num_prompts` prompts, in file order, cycling when the set is smaller.

    File order (not a shuffle) keeps every arm of a sweep on the same prompts in the same order.
    """
    if num_prompts < 1:
        raise DatasetError(f"--num-prompts must be at least 1, got {num_prompts}")
    if dataset == "random":
        return random_prompts(num_prompts, random_input_len, seed)
    if dataset == "eval-code":
        p = eval_code_path()
        if not p.is_file():
            raise DatasetError(
                f"the packaged eval-code prompt set is missing ({p}); "
                "use --dataset jsonl --dataset-path FILE or --dataset random"
            )
        base = read_jsonl_prompts(p)
    elif dataset == "jsonl":
        if not path:
            raise DatasetError("--dataset jsonl needs --dataset-path FILE (one {\"prompt\": ...} per line)")
        base = read_jsonl_prompts(path)
    else:
        raise DatasetError(f"unknown dataset {dataset!r}; use eval-code, jsonl or random")
    return [base[i % len(base)] for i in range(num_prompts)]


def describe(dataset: str, path: str | None, random_input_len: int, seed: int) -> dict:
    """The prompt set as the manifest records it."""
    if dataset == "random":
        return {"dataset": "random", "random_input_len": random_input_len, "seed": seed}
    if dataset == "eval-code":
        return {"dataset": "eval-code", "path": str(eval_code_path())}
    return {"dataset": dataset, "path": str(path)}
