"""The working tree must leave room for the server's wheels in a GPU-machine call.

A device call carries the tracked files and the wheels it names (`carry`) in at most 64 MiB, counted
as the files take on disk (H100 run 57: 61 MiB of tracked files plus 6.5 MiB of wheels was refused,
plus 2.9 MiB was accepted). `adaspec serve` there needs the wheels of
benchmarks/fetch_server_wheels.sh (6.5 MiB), so the tracked files must stay under 57 MiB; results
that would push them past it are compressed or moved to git history first
(benchmarks/results/COMPRESSION.md, benchmarks/restore_archived.sh)."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 57
BLOCK = 4096  # what a file takes on disk, at least: whole blocks


def on_disk(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def test_on_disk_counts_whole_blocks():
    assert [on_disk(n) for n in (0, 1, 4096, 4097)] == [0, 4096, 4096, 8192]


def test_the_tracked_files_leave_room_for_the_server_wheels():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    sizes = {p: on_disk(p.stat().st_size) for p in paths if p.is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total <= LIMIT_MIB * 2**20, (
        f"the tracked files take {total / 2**20:.1f} MiB on disk, over {LIMIT_MIB} MiB: with the server's wheels "
        f"(6.5 MiB) a GPU-machine call would be refused; compress or archive results (benchmarks/results/"
        f"COMPRESSION.md). Largest: {', '.join(f'{p.relative_to(ROOT)} ({sizes[p] / 2**20:.1f} MiB)' for p in largest)}")
