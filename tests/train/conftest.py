"""Shared micro fixtures: a small corpus from stdlib modules, a small tokenizer, a micro model."""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

STDLIB_MODULES = [
    "argparse.py", "bisect.py", "calendar.py", "colorsys.py", "copy.py", "dataclasses.py", "difflib.py",
    "enum.py", "fnmatch.py", "functools.py", "getopt.py", "glob.py", "heapq.py", "json/__init__.py",
    "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py", "queue.py", "sched.py",
    "shlex.py", "string.py", "textwrap.py", "tokenize.py", "abc.py", "base64.py", "contextlib.py",
    "csv.py", "fractions.py", "graphlib.py", "keyword.py", "linecache.py", "numbers.py", "operator.py",
    "pprint.py", "reprlib.py", "secrets.py", "statistics.py", "this.py", "timeit.py",
]


def make_source_tree(root: Path) -> Path:
    """Copies of some stdlib modules, one non-UTF-8 file, and a site-packages dir to be skipped."""
    from adaspec.train.corpus import default_source

    std = default_source()
    root.mkdir(parents=True, exist_ok=True)
    for rel in STDLIB_MODULES:
        if (std / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(std / rel, root / rel)
    (root / "latin1_module.py").write_bytes("# caf\xe9\nx = 1\n".encode("latin-1"))
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "site-packages" / "pkg" / "mod.py").write_text("print('third party')\n")
    return root


@pytest.fixture
def source_tree(tmp_path):
    """A fresh source tree (see make_source_tree)."""
    return make_source_tree(tmp_path / "src")


@pytest.fixture(scope="session")
def make_tree():
    return make_source_tree


@pytest.fixture(scope="session")
def make_target_args():
    return target_args


@pytest.fixture(scope="session")
def micro_corpus(tmp_path_factory) -> Path:
    from adaspec.train.corpus import build_corpus

    src = make_source_tree(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("corpus")
    build_corpus(out, source=src, val_pct=20, test_pct=20)
    return out


@pytest.fixture(scope="session")
def micro_tokenizer(micro_corpus, tmp_path_factory) -> Path:
    from adaspec.train.tokenizer import save_tokenizer, train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(micro_corpus, vocab_size=512), out)
    return out


def target_args(corpus: Path, tokenizer: Path, out: Path, **kw) -> argparse.Namespace:
    """The parsed arguments of `adaspec train target` for a micro model (overrides in kw)."""
    from adaspec.train.target import add_subparser

    parser = argparse.ArgumentParser()
    add_subparser(parser.add_subparsers())
    argv = ["target", "--corpus", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out),
            "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--intermediate", "128", "--max-position", "256", "--seq-len", "64", "--batch-size", "16",
            "--lr", "3e-3", "--warmup", "20", "--eval-every", "50", "--eval-tokens", "4096",
            "--save-dtype", "float32", "--device", "cpu",
            "--threads", "1"]  # 1 thread: small matmuls, and no OpenMP thrash on a busy 2-core box
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return parser.parse_args(argv)


@pytest.fixture(scope="session")
def micro_model(micro_corpus, micro_tokenizer, tmp_path_factory) -> Path:
    from adaspec.train.target import train_target

    out = tmp_path_factory.mktemp("model")
    train_target(target_args(micro_corpus, micro_tokenizer, out, steps=150))
    return out
