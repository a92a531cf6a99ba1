"""Slim a sweep's per-point archive (`h200_frontier.sh` MODE=server or `h200_moving_load.sh`) for the
working tree, which travels to the GPU machine with every call (64 MiB in all, the wheels included):
every point's per-request arrays `itls` (each inter-chunk gap) and `chunk_tokens` (tokens per chunk)
are set to null, and the server logs lose their per-request lines (uvicorn's access log and the
server's request log: a prompt length and SamplingParams per request, which the points record too;
in H200 run 32 they were 5.4 MB of each 5.4 MB log, the other lines 3 KB), replaced by one line
that counts them; the rest of the archive (manifest, the logs' other lines, the report and plot as
the run wrote them) is kept as it was. The points keep everything else: send offsets, lengths,
TTFT, end-to-end latency and finish reason of every request, and the summaries computed from the
arrays (ITL percentiles, chunk counts, bursts).

Before writing, the report is built from the folder as it was and as slimmed, by the code of this
checkout: the archive is written only if both are identical (nothing the report says is lost).
Commit the unslimmed archive first, so that git history keeps every request's chunk times.

    python3 benchmarks/slim_sweep_archive.py IN.tar.{gz,xz} OUT.tar.xz
"""
import argparse
import json
import lzma
import re
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec.bench.report import write_report  # noqa: E402

DROPPED_ARRAYS = ("itls", "chunk_tokens")
REPORT_FILES = ("report.md", "frontier.png", "report.html")  # rewritten by the check, then put back
PER_REQUEST_LINE = re.compile(r'^INFO:\s+\S+ - "POST /v1/(chat/)?completions HTTP/[\d.]+" \d+|'
                              r" adaspec\.serve: request (chat)?cmpl-")


def sweep_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("points") if p.is_dir())


def report_of(sweep: Path) -> str:
    write_report(sweep)
    return (sweep / "report.md").read_text()


def slim_points(sweep: Path) -> int:
    n = 0
    for f in sorted((sweep / "points").glob("*.json")):
        point = json.loads(f.read_text())
        for key in DROPPED_ARRAYS:
            if point.get(key) is not None:
                point[key] = None
        f.write_text(json.dumps(point))
        n += 1
    return n


def slim_logs(sweep: Path) -> int:
    """Removes the per-request lines of the sweep's server logs; returns how many."""
    n = 0
    for f in sorted((sweep / "logs").glob("*.log")):
        lines = f.read_text(errors="replace").splitlines(keepends=True)
        kept = [line for line in lines if not PER_REQUEST_LINE.search(line)]
        removed = len(lines) - len(kept)
        if removed:
            f.write_text("".join(kept) + f"[slim_sweep_archive.py: {removed} per-request lines removed "
                         "(uvicorn's access log and the server's request log)]\n")
            n += removed
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    if not args.out.name.endswith(".tar.xz"):
        ap.error(f"OUT must end in .tar.xz, got {args.out}")
    size_in = args.archive.stat().st_size  # before OUT, which may be the same file, is written
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with tarfile.open(args.archive) as t:
            t.extractall(root, filter="data")
        top = sorted(p.name for p in root.iterdir())
        sweeps = sweep_dirs(root)
        if not sweeps:
            raise SystemExit(f"{args.archive}: no sweep folder (a folder with points/) inside")
        for sweep in sweeps:
            as_written = {name: (sweep / name).read_bytes() for name in REPORT_FILES if (sweep / name).exists()}
            before = report_of(sweep)
            n = slim_points(sweep)
            removed = slim_logs(sweep)
            after = report_of(sweep)
            if before != after:
                raise SystemExit(f"{args.archive}: the report of {sweep.relative_to(root)} changes once slimmed; "
                                 "nothing written")
            for name in REPORT_FILES:
                (sweep / name).unlink(missing_ok=True)
                if name in as_written:
                    (sweep / name).write_bytes(as_written[name])
            print(f"{sweep.relative_to(root)}: {n} points slimmed, {removed} per-request log lines removed, "
                  "report unchanged")
        with lzma.open(args.out, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as t:
            for name in top:
                t.add(root / name, arcname=name)
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes; in: {size_in:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
