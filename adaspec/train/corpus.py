"""`adaspec train corpus`: a text corpus split into train / val / test by a hash of each path.

Default source: the Python sources of the running interpreter's standard library. Choices:

- ``site-packages`` / ``dist-packages`` and ``__pycache__`` are skipped: third-party code
  differs from machine to machine, the standard library does not (for one Python version).
- ``test/`` packages are KEPT: tests are Python code too, and they are about half the bytes.
- Files that are not valid UTF-8 (the stdlib has a few on purpose, e.g. ``bad_coding*.py``)
  or contain NUL bytes are skipped and counted in stats.json, never fatal.

The split depends only on the file's path relative to the source root (sha1 of the POSIX
form), so the same files land in the same split on every machine and in any listing order.
Output: ``train.jsonl``, ``val.jsonl``, ``test.jsonl`` (one ``{"text", "path"}`` per line,
sorted by path) and ``stats.json``.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

from adaspec.errors import AdaspecError

SPLITS = ("train", "val", "test")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}
DEFAULT_SUFFIXES = (".py",)


def split_of(rel_path: str, val_pct: int = 5, test_pct: int = 5) -> str:
    """Deterministic split of one file from its relative POSIX path."""
    h = int.from_bytes(hashlib.sha1(rel_path.encode("utf-8")).digest()[:8], "big") % 100
    if h < 100 - val_pct - test_pct:
        return "train"
    return "val" if h < 100 - test_pct else "test"


def default_source() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_source_files(root: Path, suffixes: Iterable[str] = DEFAULT_SUFFIXES) -> Iterator[tuple[str, Path]]:
    """(relative POSIX path, absolute path) for every matching file, sorted by relative path."""
    suffixes = tuple(suffixes)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if name.endswith(suffixes):
                p = Path(dirpath) / name
                found.append((p.relative_to(root).as_posix(), p))
    found.sort()
    return iter(found)


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 text (undecodable or has NUL bytes)."""
    data = path.read_bytes()
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def iter_jsonl_docs(path: Path) -> Iterator[tuple[str, str | None]]:
    """(path-like key, text) from a jsonl file with a "text" field; key = "path"/"id" or line number."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise AdaspecError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
            text = rec.get("text") if isinstance(rec, dict) else None
            key = str(rec.get("path") or rec.get("id") or f"line-{i:09d}") if isinstance(rec, dict) else f"line-{i:09d}"
            yield key, text if isinstance(text, str) else None


def build_corpus(
    out: Path,
    source: Path | None = None,
    jsonl: Path | None = None,
    suffixes: Iterable[str] = DEFAULT_SUFFIXES,
    val_pct: int = 5,
    test_pct: int = 5,
) -> dict:
    """Write the three split files and stats.json into ``out``; returns the stats."""
    if source is not None and jsonl is not None:
        raise AdaspecError("give --source or --jsonl, not both")
    if jsonl is not None:
        if not jsonl.is_file():
            raise AdaspecError(f"--jsonl {jsonl}: no such file")
        docs = iter_jsonl_docs(jsonl)
        origin = {"jsonl": str(jsonl)}
    else:
        root = source or default_source()
        if not root.is_dir():
            raise AdaspecError(f"--source {root}: no such directory")
        docs = ((rel, read_text(p)) for rel, p in iter_source_files(root, suffixes))
        origin = {"source": str(root), "default_stdlib": source is None}
    records: dict[str, list[dict]] = {s: [] for s in SPLITS}
    skipped: list[str] = []
    empty = 0
    for key, text in docs:
        if text is None:
            skipped.append(key)
            continue
        if not text.strip():
            empty += 1
            continue
        records[split_of(key, val_pct, test_pct)].append({"text": text, "path": key})
    if not any(records.values()):
        raise AdaspecError("the corpus is empty: no readable documents found")
    out.mkdir(parents=True, exist_ok=True)
    stats = {
        **origin,
        "suffixes": list(suffixes),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_executable": sys.executable,
        "split_rule": f"sha1(relative path) % 100: <{100 - val_pct - test_pct} train, <{100 - test_pct} val, else test",
        "skipped_not_utf8": len(skipped),
        "skipped_paths": skipped,
        "skipped_empty": empty,
        "splits": {},
    }
    for split in SPLITS:
        recs = sorted(records[split], key=lambda r: r["path"])
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        stats["splits"][split] = {
            "files": len(recs),
            "bytes": sum(len(r["text"].encode("utf-8")) for r in recs),
            "chars": sum(len(r["text"]) for r in recs),
        }
    stats["files"] = sum(s["files"] for s in stats["splits"].values())
    stats["bytes"] = sum(s["bytes"] for s in stats["splits"].values())
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def iter_split(corpus: Path, split: str) -> Iterator[dict]:
    """Records {"text", "path"} of one split of a built corpus."""
    path = Path(corpus) / f"{split}.jsonl"
    if not path.is_file():
        raise AdaspecError(f"{path} not found: build the corpus first with `adaspec train corpus --out {corpus}`")
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def add_subparser(sub) -> None:
    p = sub.add_parser(
        "corpus",
        help="build a train/val/test text corpus (default: this Python's standard library sources)",
        description=__doc__,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--source", type=Path, help="directory tree of source/text files (default: the stdlib)")
    src.add_argument("--jsonl", type=Path, help="jsonl file with a 'text' field per line")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--suffix", action="append", dest="suffixes", metavar=".EXT",
                   help="file suffixes to take from --source (repeatable; default .py)")
    p.add_argument("--val-pct", type=int, default=5)
    p.add_argument("--test-pct", type=int, default=5)
    p.set_defaults(func=_run)


def _run(args) -> int:
    stats = build_corpus(
        args.out, source=args.source, jsonl=args.jsonl, suffixes=args.suffixes or DEFAULT_SUFFIXES,
        val_pct=args.val_pct, test_pct=args.test_pct,
    )
    sp = stats["splits"]
    print(
        f"corpus: {stats['files']} files, {stats['bytes'] / 1e6:.1f} MB "
        f"(train {sp['train']['files']}, val {sp['val']['files']}, test {sp['test']['files']}); "
        f"skipped {stats['skipped_not_utf8']} non-UTF-8 -> {args.out}"
    )
    return 0
