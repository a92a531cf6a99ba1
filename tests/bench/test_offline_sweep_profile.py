"""benchmarks/offline_sweep.py --profile: a listed point runs once more under torch.profiler after
the sweep, outside its points, and the result says where that run's time went."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from offline_sweep import parse_profile_points  # noqa: E402


def test_profile_points_are_points_of_the_sweep():
    arms, concs = ["none", "adaptive:7"], [1, 256]
    assert parse_profile_points("adaptive:7@256, none@1", arms, concs) == [("adaptive:7", 256), ("none", 1)]
    assert parse_profile_points(None, arms, concs) == [] and parse_profile_points("", arms, concs) == []
    with pytest.raises(SystemExit, match="not a point of this sweep"):
        parse_profile_points("fixed:3@256", arms, concs)
    with pytest.raises(SystemExit, match="not a point of this sweep"):
        parse_profile_points("none@64", arms, concs)
    for bad in ("none", "none@", "none@x"):
        with pytest.raises(SystemExit, match="write ARM@CONCURRENCY"):
            parse_profile_points(bad, arms, concs)


@pytest.mark.slow
def test_a_profiled_point_is_recorded_apart_from_the_measured_ones(tmp_path):
    out = tmp_path / "sweep.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ADASPEC_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(
        [sys.executable, "benchmarks/offline_sweep.py", "--model", "tiny", "--arms", "none,fixed:3",
         "--concurrency", "2", "--num-prompts", "2", "--output-len", "4", "--repeats", "1", "--device", "cpu",
         "--threads", "2", "--interleave", "--profile", "fixed:3@2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [(x["arm"], x["repeat"]) for x in d["rows"]] == [("none", 0), ("fixed:3", 0)]  # not among the points
    prof = d["profiles"]
    assert list(prof) == ["fixed:3@2"]
    p = prof["fixed:3@2"]
    assert p["timer"] == "CPU ops" and p["steps"] > 0 and 0 < p["timed_ms_per_step"]
    assert p["busy_share"] == pytest.approx(p["timed_ms_per_step"] / p["wall_ms_per_step"], abs=1e-3)
    assert p["top"] and all(t["ms_per_step"] > 0 for t in p["top"]) and "aten::mm" in {t["name"] for t in p["top"]}
    assert p["profiled_output_throughput"] > 0 and set(p["step_kinds"]) <= {"prefill", "decode", "decode_full_batch"}
    assert "profile fixed:3@2:" in r.stdout
