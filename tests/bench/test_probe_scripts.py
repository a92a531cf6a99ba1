"""The CPU paths of two measurement scripts that otherwise run only when someone profiles:
benchmarks/host_spec_step_bench.py (the host's work per speculative decode step, graphs stubbed)
and benchmarks/probes/mixed_step_profile.py (where the steps go under arrivals, per arm). Both
broke silently before: the first when the graphed step's launch gained an argument its stub did
not take."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MICRO = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192, "max_position_embeddings": 512}


def run(args, tmp_path, **env):
    e = {**os.environ, "PYTHONPATH": str(ROOT), "ADASPEC_CACHE_DIR": str(tmp_path / "cache"), **env}
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_host_spec_step_bench_runs_the_stubbed_graphed_step(tmp_path):
    out = tmp_path / "host.json"
    stdout = run(["benchmarks/host_spec_step_bench.py", "--batch", "8", "--steps", "3", "--repeats", "2",
                  "--out", str(out)], tmp_path)
    assert "batch 8, final_only outputs, fixed:7: host step" in stdout
    d = json.loads(out.read_text())
    assert len(d["runs_ms"]) == 2 and all(ms > 0 for ms in d["runs_ms"])
    assert min(d["runs_ms"]) <= d["median_ms"] <= max(d["runs_ms"])


def test_mixed_step_profile_on_a_micro_shape(tmp_path):
    conc, waves, out_len = 4, 2, 6
    stdout = run(["benchmarks/probes/mixed_step_profile.py", "--device", "cpu", "--arms", "none,fixed:3",
                  "--concurrency", str(conc), "--waves", str(waves), "--output-len", str(out_len),
                  "--shape-overrides", json.dumps(MICRO)], tmp_path, OUT=str(tmp_path / "out"))
    assert "none @ 4:" in stdout and "fixed:3 @ 4:" in stdout
    d = json.loads((tmp_path / "out" / "mixed_step_profile.json").read_text())
    assert d["synthetic_acceptance"] == "timing only" and d["device"] == "cpu"
    assert [r["arm"] for r in d["rows"]] == ["none", "fixed:3"]
    for row in d["rows"]:
        timed, prof = row["timed"], row["profiled"]
        assert timed["total_output_tokens"] == conc * waves * out_len
        kinds = timed["step_kinds"]
        assert kinds["prefill"]["steps"] > 0 and kinds["decode"]["steps"] > 0
        assert kinds["prefill"]["tokens"] + kinds["decode"]["tokens"] == timed["total_output_tokens"]
        # every step call of the profiled pass was classified, and each kind has a wall time
        assert prof["prefill"]["steps"] > 0 and prof["decode"]["steps"] > 0
        assert prof["prefill"]["wall_ms_per_step_profiled"] > 0 and prof["decode"]["kernel_ms_per_step"] == 0.0
    text = (tmp_path / "out" / "mixed_step_profile.txt").read_text()
    assert text.count("---- host (cProfile by own time") == 2 and text.count("---- kernels") == 2
    assert "synthetic acceptance: timing only" in text.splitlines()[0]
