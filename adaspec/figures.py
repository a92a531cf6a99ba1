"""Saving matplotlib figures as small PNGs: line plots of a few colours, stored with a 256-colour
palette (Pillow, which matplotlib itself requires), are a third the size of matplotlib's RGBA files
and look the same. The results live in the repository, which travels to the GPU machine whole
within 64 MiB, and the reports and cards write one or more plots per run."""
from __future__ import annotations

import io
from pathlib import Path


def save_png(fig, path, dpi: float | None = None) -> Path:
    """fig as a palette PNG at path (dpi: matplotlib's, default the figure's)."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as im:
        small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    path = Path(path)
    small.save(path, format="PNG", optimize=True)
    return path
