"""Nothing adaspec writes may land inside the installed package: a run would silently change
the shipped models (the embedded drafter's config.json, its calibration plot, ...) for every
later user. Every command that writes checks its output paths here."""
from __future__ import annotations

import argparse
from pathlib import Path

from adaspec.errors import AdaspecError

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the adaspec/ package root


def inside_package(path: str | Path) -> bool:
    return Path(path).expanduser().resolve().is_relative_to(PACKAGE_DIR)


def refuse_package_path(path: str | Path, what: str, hint: str = "pass a path outside it") -> Path:
    """`path`, or AdaspecError naming `what` when it lies inside the installed adaspec package."""
    p = Path(path).expanduser()
    if inside_package(p):
        raise AdaspecError(
            f"{what + ': ' if what else ''}{path} is inside the installed adaspec package ({PACKAGE_DIR}), and adaspec never writes "
            f"there (the packaged models must stay as shipped); {hint}")
    return p


def unwritable(path: str | Path, kind: str) -> str | None:
    """Why `path` cannot be written as a `kind` ("file" or "dir"), or None: checked before a command
    spends its time (a profile or an evaluation lost its results to a path that could never be
    written). The path may not exist yet: its nearest existing ancestor must be a writable directory."""
    import os

    p = Path(path).expanduser()
    if p.exists():
        if kind == "file" and p.is_dir():
            return f"{path} is a directory, not a file"
        if kind == "dir" and not p.is_dir():
            return f"{path} exists and is not a directory"
        return None if os.access(p if kind == "dir" else p.parent, os.W_OK) else f"{path} is not writable"
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be made: {parent} is not a directory"
    return None if os.access(parent, os.W_OK) else f"{path} cannot be made: {parent} is not writable"


class OutputPath:
    """argparse `type` for an output path: refused at parse time when inside the package, and with
    `kind` ("file" or "dir") when it cannot be written as one (unwritable). `convert` is the
    option's own type (applied first), e.g. Path."""

    def __init__(self, convert=str, kind: str | None = None):
        self.convert = convert
        self.kind = kind
        self.__name__ = getattr(convert, "__name__", "path")

    def __call__(self, text: str):
        value = self.convert(text)
        try:
            refuse_package_path(value, "")  # argparse names the option
        except AdaspecError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        problem = unwritable(value, self.kind) if self.kind else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


def mark_outputs(parser: argparse.ArgumentParser, *dests: str) -> None:
    """Make the options `dests` of `parser` (declared elsewhere) output paths."""
    found = {a.dest: a for a in parser._actions}
    for dest in dests:
        action = found[dest]  # KeyError: the parser no longer has it; update the caller
        if not isinstance(action.type, OutputPath):
            action.type = OutputPath(action.type or str)
