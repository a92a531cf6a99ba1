"""`adaspec` command line: one dispatcher, each command group registered by its own module.

Every group module exposes ``add_parser(subparsers)`` that registers its subcommand(s) with
``set_defaults(func=callable(args) -> int)``. Group modules import heavy libraries (torch,
the server) inside their handlers, so ``adaspec --help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from adaspec.commands.options import ENGINE_OPTIONS, SHARED_OPTIONS, ArgumentParser, apply_shared_help
from adaspec.commands.writable import mark_outputs
from adaspec.errors import AdaspecError

# Order = order in `adaspec --help`.
_GROUP_MODULES = [
    "adaspec.commands.generate",
    "adaspec.serve.cli",
    "adaspec.bench.cli",
    "adaspec.commands.demo",
    "adaspec.commands.profile",
    "adaspec.train.cli",
    "adaspec.commands.eval",
]


# Output paths of commands whose modules declare them as plain options (module: dests); the
# check that refuses paths inside the installed package is added here, in one place.
_OUTPUTS = {("bench", "serve"): ("result_dir",), ("bench", "sweep"): ("out",), ("bench", "report"): ("dir",),
            ("demo",): ("out",)}


def _subparser(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    for name in path:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or name not in action.choices:
            return None
        parser = action.choices[name]
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="adaspec",
        description="LLM inference with confidence-scheduled speculative decoding, and its benchmark.",
        epilog="Run adaspec COMMAND --help for the options of a command.",
    )
    from adaspec import __version__

    parser.add_argument("--version", action="version", version=f"adaspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _GROUP_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # group not built yet
                continue
            raise
        module.add_parser(sub)
    for path, dests in _OUTPUTS.items():
        p = _subparser(parser, path)
        if p is not None:
            mark_outputs(p, *dests)
    serve = _subparser(parser, ("serve",))
    if serve is not None:  # serve declares its engine flags itself; their help is the shared one
        apply_shared_help(serve, ENGINE_OPTIONS)
    apply_shared_help(parser, SHARED_OPTIONS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except AdaspecError as e:
        print(f"adaspec: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be read or written (its message names it): no traceback
        print(f"adaspec: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
