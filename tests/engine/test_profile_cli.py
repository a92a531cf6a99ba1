import json
import subprocess
import sys


def test_profile_command_prints_tables_and_writes_plot(micro_qwen3, tmp_path):
    from adaspec.testing import make_micro_drafter_dir

    d = make_micro_drafter_dir(tmp_path / "d", micro_qwen3, block_size=3)
    spec = json.dumps({"method": "dspark", "model": str(d), "cost_model_cache_dir": str(tmp_path / "cache")})
    cmd = [sys.executable, "-m", "adaspec.cli", "profile", str(micro_qwen3), "--speculative-config", spec,
           "--out", str(tmp_path / "out"), "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "verify cost" in r.stdout and "draft cost" in r.stdout
    doc = json.loads((tmp_path / "out" / "cost_model.json").read_text())
    ms = doc["cost_model"]["verify"]["ms"]
    assert ms == sorted(ms) and ms[0] > 0  # forced non-decreasing, real timings
    assert (tmp_path / "out" / "cost_model.png").stat().st_size > 1000
    # a second run loads the cached tables: same numbers
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0, r2.stderr
    assert json.loads((tmp_path / "out" / "cost_model.json").read_text())["cost_model"] == doc["cost_model"]
