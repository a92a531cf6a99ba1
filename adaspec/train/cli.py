"""Build the models adaspec ships, from scratch: a corpus, a byte-level BPE tokenizer, a
Qwen3-architecture target, an evaluation prompt set, a DSpark drafter for the target, the
drafter's confidence calibration, and a model card.

Each subcommand lives in its own module exposing add_subparser(sub); a module listed here that
does not exist yet is skipped.
"""
from __future__ import annotations

import importlib

from adaspec.commands.options import TRAIN_OPTIONS, apply_shared_help
from adaspec.commands.writable import mark_outputs

_SUBCOMMAND_MODULES = [
    "adaspec.train.corpus",
    "adaspec.train.tokenizer",
    "adaspec.train.target",
    "adaspec.train.prompts",
    "adaspec.train.card",
    "adaspec.train.drafter",
    "adaspec.train.calibrate",
    "adaspec.train.pair",
]
# what each subcommand writes (its --out; card writes MODEL_CARD.md into --model): never
# inside the installed package
_OUTPUT_DESTS = {"card": ("model",)}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="build corpora and tokenizers, train target and drafter models",
                              description=__doc__)
    sub = p.add_subparsers(dest="train_command", metavar="WHAT")
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # not built yet
                continue
            raise
        module.add_subparser(sub)
    for name, parser in sub.choices.items():
        dests = _OUTPUT_DESTS.get(name, ("out",) if any(a.dest == "out" for a in parser._actions) else ())
        mark_outputs(parser, *dests)
    # the subcommand modules declare these themselves; one help text for each, here
    apply_shared_help(p, TRAIN_OPTIONS)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
