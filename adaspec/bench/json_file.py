"""Reading a result JSON that may be compressed: the GPU runs keep their larger sweeps as
`.json.xz` (the repository travels to the GPU machine whole, within 64 MiB), and the scripts that
table or replay them take either form."""
from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path


def read_json(path: str | Path):
    """The JSON document in path: plain, or compressed when its name ends in .xz or .gz."""
    p = Path(path)
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(p.suffix, open)
    with opener(p, "rt", encoding="utf-8") as f:
        return json.load(f)
