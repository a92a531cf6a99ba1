"""`adaspec train corpus`: a text corpus split into train / val / test by a hash of each path.

Sources (``--source``, repeatable; default ``stdlib``):

- ``stdlib``: the Python sources of the running interpreter's standard library. Its files are
  keyed by their path relative to the stdlib root, unprefixed, so their split is the one the
  `tiny` corpus and the shipped ``eval-code`` prompts were cut from.
- ``site-packages``: every site-packages / dist-packages directory of the running interpreter
  (``site.getsitepackages()``, the user site, sysconfig's purelib/platlib), keyed
  ``site-packages/<path>``. Third-party code differs from machine to machine: the corpus stats
  record what was found.
- ``DIR`` or ``NAME=DIR``: any directory tree, keyed ``NAME/<path>`` (NAME: the directory's
  name unless given).

``--max-source-bytes N`` takes at most about N bytes of each source: the files in the order of a
hash of their key, while the budget lasts (a smaller source is taken whole). The sample of a source
does not depend on the other sources, and each file keeps its key's split.

Within a source, nested ``site-packages`` / ``dist-packages`` and ``__pycache__`` are skipped.
- ``test/`` packages are KEPT: tests are Python code too, and they are about half the bytes.
- Files that are not valid UTF-8 (the stdlib has a few on purpose, e.g. ``bad_coding*.py``)
  or contain NUL bytes are skipped and counted in stats.json, never fatal.

The split depends only on the file's key (sha1 of the POSIX form), so the same files land in
the same split on every machine, in any listing order, and whatever other sources are added.
Identical files (same content) are kept once: the copy in the most held-out split (test, then
val, then train; ties: the smaller key), so no text of a held-out split is ever trained on, and
the choice depends neither on the order of the sources nor on which other sources are given.
Output: ``train.jsonl``, ``val.jsonl``, ``test.jsonl`` (one ``{"text", "path", "source"}`` per
line, sorted by path) and ``stats.json`` (per split and per source: files, bytes, duplicates
dropped; per-source token counts are added once a tokenizer has tokenized the corpus, see
adaspec/train/data.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import site
import sys
import sysconfig
from dataclasses import dataclass
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


def site_packages_dirs() -> list[Path]:
    """The running interpreter's site-packages / dist-packages directories that exist (deduplicated)."""
    cands = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    cands += [site.getusersitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    seen, out = set(), []
    for c in cands:
        p = Path(c)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            out.append(p)
    return out


@dataclass(frozen=True)
class Source:
    """One named source: directory roots whose files are keyed ``prefix + relative path``."""

    name: str
    roots: tuple[Path, ...]
    prefix: str

    def describe(self) -> dict:
        return {"name": self.name, "roots": [str(r) for r in self.roots], "key_prefix": self.prefix}


def resolve_source(spec: str | Path) -> Source:
    """'stdlib', 'site-packages', 'DIR' or 'NAME=DIR' -> Source."""
    spec = str(spec)
    if spec == "stdlib":
        return Source("stdlib", (default_source(),), "")
    if spec in ("site-packages", "dist-packages"):
        dirs = site_packages_dirs()
        if not dirs:
            raise AdaspecError("--source site-packages: this interpreter has no site-packages directory")
        return Source("site-packages", tuple(dirs), "site-packages/")
    name, _, path = spec.partition("=") if "=" in spec else ("", "", spec)
    root = Path(path).expanduser()
    if not root.is_dir():
        raise AdaspecError(f"--source {spec}: no such directory")
    name = name or root.resolve().name
    if not name or "/" in name or name in ("stdlib", "site-packages"):
        raise AdaspecError(f"--source {spec}: name the source with NAME=DIR (NAME without '/', not a reserved name)")
    return Source(name, (root,), name + "/")


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


def iter_jsonl_docs(path: Path) -> Iterator[tuple[str, str | None, str | None]]:
    """(path-like key, text, source name or None) from a jsonl file with a "text" field; key = "path"/"id" or
    line number; source: the record's "source" field (a corpus split file read back keeps its sources)."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise AdaspecError(f"{path}:{i + 1}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                yield f"line-{i:09d}", None, None
                continue
            text, source = rec.get("text"), rec.get("source")
            key = str(rec.get("path") or rec.get("id") or f"line-{i:09d}")
            yield key, text if isinstance(text, str) else None, source if isinstance(source, str) else None


SPLIT_RANK = {"test": 0, "val": 1, "train": 2}  # dedup keeps the most held-out copy


def build_corpus(
    out: Path,
    source: Path | None = None,
    jsonl: Path | None = None,
    suffixes: Iterable[str] = DEFAULT_SUFFIXES,
    val_pct: int = 5,
    test_pct: int = 5,
    sources: Iterable[str | Path | Source] | None = None,
    max_source_bytes: int | None = None,
) -> dict:
    """Write the three split files and stats.json into ``out``; returns the stats.

    ``sources``: specs for resolve_source (or Source objects). ``source``: one directory keyed by
    its bare relative paths (the single-tree form). Neither: the standard library.
    ``max_source_bytes``: at most about this many bytes of each source (a deterministic sample by
    key hash; a source smaller than that is taken whole)."""
    suffixes = tuple(suffixes)
    if not (0 <= val_pct and 0 <= test_pct and val_pct + test_pct < 100):
        raise AdaspecError(f"--val-pct and --test-pct must be >= 0 and leave the train split some of the 100 "
                           f"hash buckets; got {val_pct} and {test_pct}")
    given = sum(x is not None for x in (source, jsonl, sources))
    if given > 1:
        raise AdaspecError("give --source or --jsonl, not both")
    if jsonl is not None:
        if not jsonl.is_file():
            raise AdaspecError(f"--jsonl {jsonl}: no such file")
        srcs = [Source("jsonl", (Path(jsonl),), "")]
        origin = {"jsonl": str(jsonl)}
    elif source is not None:
        if not Path(source).is_dir():
            raise AdaspecError(f"--source {source}: no such directory")
        srcs = [Source(Path(source).resolve().name or "source", (Path(source),), "")]
        origin = {"source": str(source), "default_stdlib": False}
    else:
        srcs = [s if isinstance(s, Source) else resolve_source(s) for s in (sources or ["stdlib"])]
        if not srcs:
            raise AdaspecError("no --source given")
        names = [s.name for s in srcs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise AdaspecError(f"source {dup[0]!r} given twice (name directory sources with NAME=DIR)")
        origin = {"source": ", ".join(str(r) for s in srcs for r in s.roots),
                  "default_stdlib": sources is None}

    per_source: dict[str, dict] = {}

    def source_stats(name: str, src: Source) -> dict:
        if name not in per_source:
            per_source[name] = {**src.describe(), "name": name, "files": 0, "bytes": 0, "duplicates_dropped": 0,
                                "skipped_not_utf8": 0, "skipped_empty": 0,
                                "splits": {sp: {"files": 0, "bytes": 0} for sp in SPLITS}}
        return per_source[name]

    best: dict[str, tuple] = {}  # content sha256 -> (rank, record)
    skipped: list[str] = []
    empty = 0
    for src in srcs:
        found: dict = {}
        for key, text, name in _iter_source_docs(src, suffixes, max_source_bytes, found):
            st = source_stats(name or src.name, src)
            st.setdefault("found", found)
            if text is None:
                skipped.append(key)
                st["skipped_not_utf8"] += 1
                continue
            if not text.strip():
                empty += 1
                st["skipped_empty"] += 1
                continue
            split = split_of(key, val_pct, test_pct)
            rec = {"text": text, "path": key, "source": st["name"], "_split": split}
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            rank = (SPLIT_RANK[split], key, src.name)
            old = best.get(digest)
            if old is None or rank < old[0]:
                if old is not None:
                    per_source[old[1]["source"]]["duplicates_dropped"] += 1
                best[digest] = (rank, rec)
            else:
                st["duplicates_dropped"] += 1
    records: dict[str, list[dict]] = {sp: [] for sp in SPLITS}
    for _, rec in best.values():
        records[rec.pop("_split")].append(rec)
    if not any(records.values()):
        raise AdaspecError("the corpus is empty: no readable documents found")
    out.mkdir(parents=True, exist_ok=True)
    stats = {
        **origin,
        "sources": list(per_source.values()),
        "suffixes": list(suffixes),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_executable": sys.executable,
        "split_rule": f"sha1(key) % 100: <{100 - val_pct - test_pct} train, <{100 - test_pct} val, else test; "
                      "key = source prefix + relative path (stdlib: no prefix)",
        "dedup_rule": "identical content kept once: the copy in the most held-out split, then the smallest key",
        "max_source_bytes": max_source_bytes,
        "skipped_not_utf8": len(skipped),
        "skipped_paths": skipped,
        "skipped_empty": empty,
        "duplicates_dropped": sum(s["duplicates_dropped"] for s in per_source.values()),
        "splits": {},
    }
    for split in SPLITS:
        recs = sorted(records[split], key=lambda r: (r["path"], r["source"]))
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        nbytes = [len(r["text"].encode("utf-8")) for r in recs]
        stats["splits"][split] = {"files": len(recs), "bytes": sum(nbytes), "chars": sum(len(r["text"]) for r in recs)}
        for r, b in zip(recs, nbytes):
            st = per_source[r["source"]]
            st["files"] += 1
            st["bytes"] += b
            st["splits"][split]["files"] += 1
            st["splits"][split]["bytes"] += b
    stats["files"] = sum(s["files"] for s in stats["splits"].values())
    stats["bytes"] = sum(s["bytes"] for s in stats["splits"].values())
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def _iter_source_docs(src: Source, suffixes: tuple[str, ...], max_bytes: int | None = None,
                      found: dict | None = None) -> Iterator[tuple[str, str | None, str | None]]:
    """(key, text or None, source name or None) of one source's documents, in key order within each root.

    ``max_bytes``: only a sample of about that many bytes (files in the order of a hash of their key,
    taken while the budget lasts), so the sample of a source is the same whatever else is given, and a
    file's split is still its key's. ``found`` receives the files and bytes before sampling."""
    if src.name == "jsonl" and src.roots[0].is_file():
        yield from iter_jsonl_docs(src.roots[0])
        return
    files = [(src.prefix + rel, p) for root in src.roots for rel, p in iter_source_files(root, suffixes)]
    sizes = {key: p.stat().st_size for key, p in files} if (max_bytes is not None or found is not None) else {}
    if found is not None:
        found.update(files=len(files), bytes=sum(sizes.values()))
    if max_bytes is not None:
        keep, total = set(), 0
        for key in sorted(sizes, key=lambda k: hashlib.sha1(("sample:" + k).encode("utf-8")).digest()):
            if total >= max_bytes:
                break
            keep.add(key)
            total += sizes[key]
        files = [(key, p) for key, p in files if key in keep]
    for key, p in files:
        yield key, read_text(p), None


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
    src.add_argument("--source", action="append", dest="sources", metavar="SRC",
                     help="repeatable: 'stdlib' (default), 'site-packages', DIR or NAME=DIR (keys NAME/<path>)")
    src.add_argument("--jsonl", type=Path, help="jsonl file with a 'text' field per line")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--suffix", action="append", dest="suffixes", metavar=".EXT",
                   help="file suffixes to take from --source (repeatable; default .py)")
    p.add_argument("--max-source-bytes", type=float, default=None,
                   help="at most about this many bytes of each source (a deterministic sample by key hash)")
    p.add_argument("--val-pct", type=int, default=5)
    p.add_argument("--test-pct", type=int, default=5)
    p.set_defaults(func=_run)


def _run(args) -> int:
    stats = build_corpus(
        args.out, sources=None if args.jsonl else args.sources, jsonl=args.jsonl,
        suffixes=args.suffixes or DEFAULT_SUFFIXES, val_pct=args.val_pct, test_pct=args.test_pct,
        max_source_bytes=int(args.max_source_bytes) if args.max_source_bytes else None,
    )
    print(summary_line(stats) + f" -> {args.out}")
    return 0


def summary_line(stats: dict) -> str:
    sp = stats["splits"]
    per = ", ".join(f"{s['name']} {s['files']} files {s['bytes'] / 1e6:.1f} MB" for s in stats.get("sources", []))
    return (f"corpus: {stats['files']} files, {stats['bytes'] / 1e6:.1f} MB "
            f"(train {sp['train']['files']}, val {sp['val']['files']}, test {sp['test']['files']}); "
            f"skipped {stats['skipped_not_utf8']} non-UTF-8, {stats.get('duplicates_dropped', 0)} duplicates"
            + (f"; {per}" if per else ""))
