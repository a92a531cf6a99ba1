"""The commit a result names: $ADASPEC_COMMIT when the caller gives it (a GPU machine's copied .git
is stale), else git's HEAD, marked unverified when the checkout differs from it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaspec.bench.conditions import engine_commit

ROOT = Path(__file__).resolve().parents[2]


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_env_wins_then_git_head_then_dirty_is_unverified(tmp_path, monkeypatch):
    monkeypatch.delenv("ADASPEC_COMMIT", raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "f.py").write_text("a = 1\n")
    git(tmp_path, "add", "f.py")
    git(tmp_path, "commit", "-qm", "one")
    head = git(tmp_path, "rev-parse", "HEAD")
    assert engine_commit(tmp_path) == head
    (tmp_path / "new.py").write_text("untracked files do not count\n")
    assert engine_commit(tmp_path) == head
    (tmp_path / "f.py").write_text("a = 2\n")  # what a stale .git beside a newer tree looks like
    assert engine_commit(tmp_path) == f"{head}-dirty (unverified)"
    monkeypatch.setenv("ADASPEC_COMMIT", "0123abc")
    assert engine_commit(tmp_path) == "0123abc"
    monkeypatch.setenv("ADASPEC_COMMIT", "  ")  # blank: not given
    assert engine_commit(tmp_path) == f"{head}-dirty (unverified)"
    assert engine_commit(tmp_path / "not-a-repo-dir-that-is-missing") is None


@pytest.mark.slow
def test_offline_sweep_records_the_commit_given_by_env(tmp_path):
    out = tmp_path / "o.json"
    env = {**os.environ, "ADASPEC_COMMIT": "c0ffee1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "benchmarks/offline_sweep.py", "--model", "tiny", "--arms", "none",
                    "--concurrency", "1", "--num-prompts", "1", "--output-len", "2", "--repeats", "1",
                    "--device", "cpu", "--threads", "1", "--out", str(out)], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["commit"] == "c0ffee1"
    host = res["rows"][0]["host"]
    assert set(host) == {"process_cpu_per_wall", "machine_busy_cpus", "loadavg_1m", "gc", "python_loop_ms"}
    assert host["python_loop_ms"] > 0  # the host's speed just before this point
    assert res["args"]["gc"] == "freeze"  # the default, recorded with the run's conditions


def test_host_speed_names_the_cpu_and_reports_the_median_time(monkeypatch):
    # a fake clock: each timed run takes 2, 4, 3, 9, 1 ms; the figure is their median (the mean is 3.8)
    import time

    from adaspec.bench import conditions

    ticks = iter([0.0, 0.002, 1.0, 1.004, 2.0, 2.003, 3.0, 3.009, 4.0, 4.001])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    monkeypatch.setattr(conditions, "cpu_model", lambda: "Test CPU 9000")
    assert conditions.host_speed() == {"cpu": "Test CPU 9000", "python_loop_ms": 3.0}
