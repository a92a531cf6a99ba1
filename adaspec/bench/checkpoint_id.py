"""Which weights a benchmark measured: a SHA-256 over the files of a checkpoint directory that decide
what the engine computes (weights, config, tokenizer), recorded in the sweep's manifest and points.

A path does not identify weights: every code-0.6b build on the GPU machine is written to /tmp/pair,
so two builds, or a sweep resumed or merged across builds, would look alike by path (H200 runs
30-32 ran sweeps on different builds at the same path). Model cards, plots and training logs in
the directory are left out: they do not change what is served.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

# What the engine reads from a checkpoint directory (models/loader.py loads safetensors only; the
# DSpark drafter's config.json holds its calibration temperatures, so a recalibration changes the id
# as it changes the drafts). Training leaves checkpoint.pt (fp32 weights and optimizer state, ~8x the
# served weights) beside them: not read by the engine, so not hashed.
PATTERNS = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_CHUNK = 8 << 20


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted({p for pat in PATTERNS for p in directory.glob(pat) if p.is_file()})


def checkpoint_sha256(name_or_path: str | Path | None) -> str | None:
    """The checkpoint's id, or None when it is not a local directory holding such files (a served
    model name, a remote server's model). Hashes the files once per process while their sizes and
    modification times stay the same (a 1 GB checkpoint takes about a second)."""
    if not name_or_path:
        return None
    from adaspec.models.registry import resolve_model_path

    d = resolve_model_path(name_or_path)
    if not d.is_dir():
        return None
    files = checkpoint_files(d)
    if not files:
        return None
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _digest(str(d.resolve()), stamp)


@functools.lru_cache(maxsize=16)
def _digest(directory: str, stamp: tuple) -> str:
    h = hashlib.sha256()
    for name, size, _ in stamp:
        h.update(f"{name}\0{size}\0".encode())
        with open(Path(directory, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def checkpoints(model: str | None, drafter: str | None) -> dict:
    """What a sweep records: {"model_sha256": ..., "drafter_sha256": ...} (None where unknown). No
    drafter given for an embedded target means its embedded drafter, which the engine then uses."""
    from adaspec.models.registry import DEFAULT_DRAFTERS

    if drafter is None and model is not None:
        drafter = DEFAULT_DRAFTERS.get(str(model))
    return {"model_sha256": checkpoint_sha256(model), "drafter_sha256": checkpoint_sha256(drafter)}
