"""`adaspec train ...`: each subcommand lives in its own module exposing ``add_subparser(sub)``.

A module listed here that does not exist yet is skipped, so ``train drafter`` and
``train calibrate`` appear as soon as their modules are added.
"""
from __future__ import annotations

import importlib

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


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="build corpora and tokenizers, train target and drafter models")
    sub = p.add_subparsers(dest="train_command", metavar="WHAT")
    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # not built yet
                continue
            raise
        module.add_subparser(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
