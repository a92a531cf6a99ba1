"""`adaspec train tokenizer`: byte-level BPE over a corpus's train split.

Byte-level with no normalizer, so ``decode(encode(s)) == s`` for every string (any Unicode,
any whitespace: indentation and ``\\r\\n`` survive). Every newline is its own pre-token, so a
prompt cut at a line boundary tokenizes exactly like the start of the full text (the model
never sees a lone newline token that in training only preceded unindented lines); after it,
runs of spaces stay whole (GPT-2's pre-tokenizer regex), which suits indented code.
Special tokens, ids in this order:

- ``<|endoftext|>`` (0): document separator, EOS and pad; no BOS is ever prepended;
- ``<|mask|>`` (1): reserved for the drafter's mask token (never seen in training text);
- ``<|im_start|>`` (2), ``<|im_end|>`` (3): for the ChatML-style chat template.

Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``, which
``transformers.AutoTokenizer`` loads as a ``PreTrainedTokenizerFast``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from adaspec.errors import AdaspecError
from adaspec.models.tokenizer import DEFAULT_CHAT_TEMPLATE

EOS = "<|endoftext|>"
MASK = "<|mask|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, MASK, IM_START, IM_END]
CHAT_TEMPLATE = DEFAULT_CHAT_TEMPLATE  # ChatML, with tools in the Hermes convention
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _texts(corpus: Path, batch: int = 256, max_bytes: int | None = None) -> Iterator[list[str]]:
    from adaspec.train.corpus import iter_split

    recs: Iterator[dict] = iter_split(corpus, "train")
    if max_bytes is not None:
        recs = iter(sample_records(list(recs), max_bytes))
    buf: list[str] = []
    for rec in recs:
        buf.append(rec["text"])
        if len(buf) == batch:
            yield buf
            buf = []
    if buf:
        yield buf


def sample_records(recs: list[dict], max_bytes: int) -> list[dict]:
    """A deterministic sample of about ``max_bytes`` of documents: records in the order of a hash of
    their path (not of their listing), taken until the budget is spent, so every source is represented
    in proportion to its size and the sample does not depend on the order of the sources."""
    import hashlib

    order = sorted(recs, key=lambda r: hashlib.sha1(("tok:" + r["path"]).encode("utf-8")).digest())
    out, total = [], 0
    for r in order:
        if total >= max_bytes:
            break
        out.append(r)
        total += len(r["text"].encode("utf-8"))
    return out


def train_tokenizer(corpus: Path, vocab_size: int = 8192, min_frequency: int = 2, model_max_length: int = 2048,
                    max_bytes: int | None = None):
    """A trained ``tokenizers.Tokenizer`` (byte-level BPE) over ``corpus``'s train split (or a
    ``max_bytes`` sample of it, see sample_records)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise AdaspecError(f"--vocab-size {vocab_size} is too small: byte-level BPE needs at least 260")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\r?\n"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_texts(corpus, max_bytes=max_bytes), trainer=trainer)
    return tok


def tokenizer_config(model_max_length: int = 2048) -> dict:
    added = {}
    for i, t in enumerate(SPECIAL_TOKENS):
        added[str(i)] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok, out: Path, model_max_length: int = 2048) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = tokenizer_config(model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    special_map = {"eos_token": EOS, "pad_token": EOS, "mask_token": MASK,
                   "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def load_raw(tokenizer_dir: Path):
    """The ``tokenizers.Tokenizer`` saved in ``tokenizer_dir``."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise AdaspecError(f"{path} not found: train one with `adaspec train tokenizer`")
    return Tokenizer.from_file(str(path))


def special_ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    import shutil

    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)


def add_subparser(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a corpus", description=__doc__)
    p.add_argument("--corpus", type=Path, required=True, help="directory written by `adaspec train corpus`")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--max-bytes", type=float, help="train on a deterministic sample of about this many bytes")
    p.add_argument("--model-max-length", type=int, default=2048)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=_run)


def _run(args) -> int:
    tok = train_tokenizer(args.corpus, args.vocab_size, args.min_frequency,
                          max_bytes=int(args.max_bytes) if args.max_bytes else None)
    save_tokenizer(tok, args.out, args.model_max_length)
    print(f"tokenizer: vocab {tok.get_vocab_size()} (specials {special_ids(tok)}) -> {args.out}")
    return 0
