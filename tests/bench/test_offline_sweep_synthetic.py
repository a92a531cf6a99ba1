"""benchmarks/offline_sweep.py with --shape (random weights) and --synthetic-acceptance, at a small
Qwen3 shape on the CPU: the plumbing the GPU's Qwen3-8B synthetic frontier uses."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LABEL = "synthetic acceptance: timing only"
SMALL = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8192, "max_position_embeddings": 512}


@pytest.mark.slow
def test_offline_sweep_on_a_shape_with_synthetic_acceptance(tmp_path):
    out = tmp_path / "sweep.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ADASPEC_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(
        [sys.executable, "benchmarks/offline_sweep.py", "--shape", "qwen3-0.6b", "--shape-overrides", json.dumps(SMALL),
         "--arms", "none,fixed:3,adaptive:3", "--synthetic-acceptance", "0.6,0.5,0.7", "--concurrency", "1,2",
         "--num-prompts", "2", "--output-len", "6", "--repeats", "1", "--max-prompt-tokens", "32", "--device", "cpu",
         "--threads", "2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"*** {LABEL}" in r.stdout
    d = json.loads(out.read_text())
    assert d["synthetic_acceptance"] == LABEL and d["args"]["shape"] == "qwen3-0.6b"
    assert d["checkpoints"] == {"model_sha256": None, "drafter_sha256": None}  # dummy weights: no files
    assert d["sampler"] == "torch" and d["markov_loop"] == "torch"  # what drafted: the torch ops on a CPU
    assert all(d["host_speed"][when]["python_loop_ms"] > 0 for when in ("start", "end"))  # the host, timed
    # the adaptive arm's profiled cost tables come back with the result; the others have none
    assert set(d["cost_tables"]) == {"adaptive:3"}
    tables = d["cost_tables"]["adaptive:3"]
    assert set(tables) == {"verify", "draft"} and all(len(t["ms"]) == len(t["sizes"]) > 1 for t in tables.values())
    assert {(x["arm"], x["concurrency"]) for x in d["rows"]} == {(a, c) for a in ("none", "fixed:3", "adaptive:3")
                                                                  for c in (1, 2)}
    for row in d["rows"]:
        assert row["total_output_tokens"] == row["num_prompts"] * 6
        split = row["step_split"]  # where the steps went: counts and ms per step, wall beside the timers
        assert split["steps"] > 0 and split["wall_ms"] > 0 and split["bookkeeping_ms"] >= 0
        assert split["draft_skipped"] <= split["steps"] and split["mixed_fused"] == 0  # the default mode
        kinds = row["step_kinds"]  # every step call is a prefill or a decode-only one, with its tokens
        assert kinds["prefill"]["steps"] + kinds["decode"]["steps"] >= split["steps"] and kinds["prefill"]["steps"] > 0
        assert kinds["prefill"]["tokens"] + kinds["decode"]["tokens"] == row["total_output_tokens"]
        assert kinds["decode"]["steps"] > 0 and kinds["decode"]["tokens_per_ms"] > 0
        # only the adaptive arm's policy has a step overhead (0 by default: the tables alone)
        assert row["policy_overhead_ms"] == (0.0 if row["arm"].startswith("adaptive") else None)
        assert row["policy_overhead"] is None  # its state is recorded only where it is measured
        if row["arm"] == "none":  # the no-spec arm: no speculative config at all, so no label
            assert "synthetic_acceptance" not in row and row["mean_accepted_length"] is None
        else:
            assert row["synthetic_acceptance"] == LABEL
    fixed = [x for x in d["rows"] if x["arm"] == "fixed:3"]
    assert all(x["mean_accepted_length"] is not None for x in fixed)


def test_arm_configs_of_a_synthetic_sweep():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from offline_sweep import arm_config
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    keys = {"synthetic_acceptance": [0.6, 0.5], "synthetic_confidence_noise": 0.05}
    assert arm_config("none", None, 0.0, keys) is None
    assert arm_config("fixed:2", None, 0.0, keys) == {"method": "synthetic", "num_speculative_tokens": 2,
                                                      "draft_sample_method": "greedy", **keys}
    assert arm_config("adaptive:2", None, 1.0, None)["method"] == "dspark"
    assert "adaptive_verification_step_costs" not in arm_config("adaptive:2", None, 0.0, None)
    measured = arm_config("adaptive-measured:2", None, 0.0, None)
    assert measured["enable_adaptive_verification"] and measured["adaptive_verification_step_costs"] == "measured"
    with pytest.raises(SystemExit, match="unknown arm"):
        arm_config("adaptive-wall:2", None, 0.0, None)


def test_speculative_config_extra_is_a_json_object_or_a_clear_exit():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from offline_sweep import speculative_config_extra
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert speculative_config_extra(None) == {}
    assert speculative_config_extra('{"adaptive_verification_step_overhead_ms": "measured"}') == {
        "adaptive_verification_step_overhead_ms": "measured"}
    with pytest.raises(SystemExit, match="not valid JSON"):
        speculative_config_extra("{bad")
    with pytest.raises(SystemExit, match="must be a JSON object"):
        speculative_config_extra("[1]")


def test_prompts_per_point_are_waves_of_the_concurrency_unless_given():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from offline_sweep import prompts_per_point
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert prompts_per_point(None, 2, 256) == 512
    assert prompts_per_point(None, 8, 64) == 512
    assert prompts_per_point(None, 8, 1) == 8  # at least 8
    assert prompts_per_point(32, 8, 256) == 32  # --num-prompts wins
    assert prompts_per_point(None, 4, 1, min_prompts=64) == 64 and prompts_per_point(None, 4, 64, min_prompts=64) == 256
    assert prompts_per_point(16, 4, 1, min_prompts=64) == 16  # --num-prompts still wins
    with pytest.raises(SystemExit, match="min-prompts"):
        prompts_per_point(None, 2, 16, min_prompts=0)
    with pytest.raises(SystemExit, match="prompts-per-concurrency"):
        prompts_per_point(None, 0, 16)
    with pytest.raises(SystemExit, match="num-prompts"):
        prompts_per_point(0, 2, 16)
