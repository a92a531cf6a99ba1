"""benchmarks/h200_frontier.sh (MODE=server) and benchmarks/h200_moving_load.sh on the CPU with the
embedded tiny pair: the plumbing of the one-command GPU runs (pair found instead of built, the
sweep through real `adaspec serve` processes, the report, at most 8 files back, the commit given
by the caller recorded)."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")  # what the device returns from $OUT


def run_script(args, env_extra, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUNS_DIR": str(tmp_path / "runs"), "ADASPEC_COMMIT": "feed123",
           "OUTPUT_LEN": "8", "NUM_WARMUPS": "0", "CUDA_VISIBLE_DEVICES": "", **env_extra}
    r = subprocess.run(["bash", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def returned_files(out: Path):
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(NAME_OK.match(p.name) for p in files)
    return sorted(p.name for p in files)


@pytest.mark.slow
def test_frontier_server_mode_on_a_built_pair(tmp_path):
    pair = tmp_path / "pair"  # as build_pair_h200.sh leaves it: target/, drafter/, pair.json
    pair.mkdir()
    (pair / "target").symlink_to(ROOT / "adaspec/assets/models/tiny")
    (pair / "drafter").mkdir()
    for f in (ROOT / "adaspec/assets/models/tiny-dspark").iterdir():
        (pair / "drafter" / f.name).symlink_to(f)
    (pair / "drafter" / "heldout_blocks.npz").write_bytes(b"blocks")  # the eval's walk blocks come back too
    (pair / "pair.json").write_text('{"build": "test"}')
    out = tmp_path / "out"
    log = run_script(["benchmarks/h200_frontier.sh", str(out), "none,fixed:3", "1,2", "0", "1"],
                     {"MODE": "server", "PAIR_DIR": str(pair), "NUM_PROMPTS": "2"}, tmp_path)
    assert (out / "heldout_blocks.npz").read_bytes() == b"blocks"
    assert returned_files(out) == ["heldout_blocks.npz", "pair.json", "server_T0.log", "server_T0.tar.gz", "server_T0_frontier.png",
                                   "server_T0_report.md", "server_T0_summary.txt"]
    md = (out / "server_T0_report.md").read_text()
    assert "| C | none | fixed:3 |" in md and "- engine commit: `feed123`" in md
    assert f"\"model\": \"{pair / 'drafter'}\"" in md  # the speculative arm ran the pair's drafter
    assert "fixed:3         2  1" in log  # the summary table printed at the end


@pytest.mark.slow
def test_moving_load_script_on_tiny(tmp_path):
    out = tmp_path / "out"
    run_script(["benchmarks/h200_moving_load.sh", str(out), "none,adaptive:7", "1x2,3x6,1x2", "1", "1"],
               {"MODEL": "tiny", "SERVER_ARGS": "--disable-log-requests"}, tmp_path)
    arms = json.loads((tmp_path / "runs" / "moving_T1" / "manifest.json").read_text())["arms"]
    assert all("--disable-log-requests" in a["server_args"] for a in arms)  # SERVER_ARGS reach every server
    assert returned_files(out) == ["moving_T1.log", "moving_T1.tar.gz", "moving_T1_frontier.png", "moving_T1_report.md"]
    md = (out / "moving_T1_report.md").read_text()
    assert "## Phase 1: concurrency 3 x 6 requests" in md and "The moving-load question" in md
    assert "| `adaptive:7` |" in md and "- engine commit: `feed123`" in md


@pytest.mark.slow
def test_server_variants_script_on_a_micro_shape(tmp_path):
    """benchmarks/h200_server_synthetic.sh: each variant's flags reach its servers, the speculative
    arm runs with synthetic acceptance, and one table pools each variant's points (one arm: every
    server start costs CI seconds, and the script treats arms alike)."""
    out = tmp_path / "out"
    shape = ('{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, '
             '"num_key_value_heads": 2, "head_dim": 16, "vocab_size": 8192, "max_position_embeddings": 512}')
    run_script(["benchmarks/h200_server_synthetic.sh", str(out), "qwen3-0.6b", "adaptive:3", "1", "1"],
                     {"DEVICE": "cpu", "SHAPE_OVERRIDES": shape, "NUM_PROMPTS": "2",
                      "VARIANTS": "thread=--no-engine-process;quiet=--no-engine-process --disable-log-requests"},
                     tmp_path)
    assert returned_files(out) == ["log.txt", "pair.json", "quiet_r1.tar.gz", "thread_r1.tar.gz",
                                   "variants.json", "variants.txt"]
    rows = json.loads((out / "variants.json").read_text())["rows"]
    assert sorted((r["variant"], r["arm"], r["concurrency"], r["n"]) for r in rows) == [
        ("quiet", "adaptive:3", 1, 1), ("thread", "adaptive:3", 1, 1)]
    assert all(r["output_throughput"][0] > 0 for r in rows)
    arms = {a["name"]: a for a in json.loads((tmp_path / "runs" / "quiet_r1" / "manifest.json").read_text())["arms"]}
    assert "--disable-log-requests" in arms["adaptive:3"]["server_args"]
    assert arms["adaptive:3"]["speculative_config"]["method"] == "synthetic"
    thread = json.loads((tmp_path / "runs" / "thread_r1" / "manifest.json").read_text())["arms"]
    assert all("--disable-log-requests" not in a["server_args"] and "--no-engine-process" in a["server_args"]
               for a in thread)
    assert (out / "variants.txt").read_text().startswith("variant")


@pytest.mark.parametrize("status", [0, 3])
def test_pack_turns_out_into_one_tar_and_keeps_the_exit_status(tmp_path, status):
    """PACK=1 (h200_common.sh): whatever a script wrote under OUT leaves as the one file OUT.tar,
    whether it ends well or not, so two scripts in one device call stay within its 8 files."""
    import tarfile

    out = tmp_path / "s1"
    script = (f'OUT={out}; mkdir -p "$OUT"; source benchmarks/h200_common.sh; '
              f'for i in 1 2 3 4 5 6 7 8 9; do echo $i > "$OUT/f$i.txt"; done; exit {status}')
    env = {**{k: v for k, v in os.environ.items() if k != "H200_NESTED"}, "PACK": "1"}
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == status, r.stderr
    assert not out.exists() and returned_files(tmp_path) == ["s1.tar"]
    with tarfile.open(tmp_path / "s1.tar") as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
        assert names == [f"s1/f{i}.txt" for i in range(1, 10)]
        assert tar.extractfile("s1/f9.txt").read() == b"9\n"


@pytest.mark.parametrize("pack", [None, "0", ""])
def test_without_pack_1_out_stays_a_folder(tmp_path, pack):
    out = tmp_path / "s1"
    script = f'OUT={out}; mkdir -p "$OUT"; source benchmarks/h200_common.sh; echo x > "$OUT/a.txt"'
    env = {k: v for k, v in os.environ.items() if k not in ("PACK", "H200_NESTED")}
    if pack is not None:
        env["PACK"] = pack
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and (out / "a.txt").read_text() == "x\n" and not (tmp_path / "s1.tar").exists()


def test_only_the_outermost_script_packs(tmp_path):
    """h200_ab_server.sh runs h200_frontier.sh inside and reads its folder afterwards: with PACK=1
    given to the outer one, the inner one must leave its folder in place."""
    out = tmp_path / "ab"
    inner = f'OUT={out}/inner; mkdir -p "$OUT"; source benchmarks/h200_common.sh; echo i > "$OUT/i.txt"'
    outer = (f'OUT={out}; mkdir -p "$OUT"; source benchmarks/h200_common.sh; bash -c \'{inner}\'; '
             f'cp "$OUT/inner/i.txt" "$OUT/copied.txt"')
    env = {k: v for k, v in os.environ.items() if k != "H200_NESTED"}
    env["PACK"] = "1"
    r = subprocess.run(["bash", "-c", outer], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert returned_files(tmp_path) == ["ab.tar"]
    import tarfile

    with tarfile.open(tmp_path / "ab.tar") as tar:
        assert sorted(m.name for m in tar.getmembers() if m.isfile()) == ["ab/copied.txt", "ab/inner/i.txt"]


def test_require_pair_stops_at_once_where_no_pair_was_built(tmp_path):
    """REQUIRE_PAIR=1 (a command sized for a warm machine that landed on a fresh one): exit 4 with a
    message that names the folder, before any build starts."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUNS_DIR": str(tmp_path / "runs"), "CUDA_VISIBLE_DEVICES": "",
           "PAIR_DIR": str(tmp_path / "nopair"), "REQUIRE_PAIR": "1", "BUDGET_S": "60"}
    r = subprocess.run(["bash", "benchmarks/h200_frontier.sh", str(tmp_path / "out"), "none", "1", "0", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"no built pair in {tmp_path / 'nopair'}" in r.stderr and "REQUIRE_PAIR=1" in r.stderr
    assert "building the pair" not in r.stdout


def test_rules_ab_runs_both_trees_and_records_each_ones_commit(tmp_path):
    """benchmarks/gpu_rules_ab.sh on the CPU: the GPU suite's run (everything deselected or skipped
    here), then the bench for this tree and for an 'older' one (this tree's package linked under
    OLD_TREE), each result naming the commit it was given; at most 8 files, all named as the device
    returns them."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "adaspec").symlink_to(ROOT / "adaspec")
    out = tmp_path / "out"
    run_script(["benchmarks/gpu_rules_ab.sh"],
               {"OUT": str(out), "DEVICE": "cpu", "SUITE_S": "300", "SUITE_TESTS": "tests/engine/test_gpu.py",
                "OLD_TREE": os.path.relpath(old, ROOT),
                "OLD_SHA": "0ld0001", "NEW_SHA": "new0002",
                "BENCH_ARGS": "--arms none --variants plain,ruled --requests 2 --max-tokens 8 --repeats 1"}, tmp_path)
    assert returned_files(out) == ["gpu.txt", "gpu_suite.txt", "lr_new.json", "lr_new.txt", "lr_old.json", "lr_old.txt"]
    for side, sha in (("new", "new0002"), ("old", "0ld0001")):
        result = json.loads((out / f"lr_{side}.json").read_text())
        assert result["conditions"]["engine_commit"].startswith(sha)
        assert {r["rule"] for r in result["results"]} == {"plain", "ruled"}
