"""The CPU paths of measurement scripts that otherwise run only when someone profiles (or, for
benchmarks/gpu_bisect.sh, only on a GPU machine):
benchmarks/host_spec_step_bench.py (the host's work per speculative decode step, graphs stubbed),
benchmarks/probes/mixed_step_profile.py (where the steps go under arrivals, per arm),
benchmarks/probes/draft_width_cost.py (a narrow draft against the full block) and
benchmarks/probes/first_request_stall.py (the first served steps with and without the startup
warm-up). The first two broke silently before: the first when the graphed step's launch gained an
argument its stub did not take."""
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
    assert "batch 8, final_only outputs, fixed:7, gc as-is, accepted 0-4: host step" in stdout
    d = json.loads(out.read_text())
    assert len(d["runs_ms"]) == 2 and all(ms > 0 for ms in d["runs_ms"])
    assert min(d["runs_ms"]) <= d["median_ms"] <= max(d["runs_ms"])
    stdout = run(["benchmarks/host_spec_step_bench.py", "--batch", "8", "--steps", "3", "--repeats", "1",
                  "--accepted", "4", "--out", str(out)], tmp_path)
    d = json.loads(out.read_text())
    assert "accepted 4: host step" in stdout and d["args"]["accepted"] == 4
    assert d["mean_accepted_length"] == 5.0  # every drafting request took 4 drafts and the bonus


def test_mixed_step_profile_on_a_micro_shape(tmp_path):
    conc, waves, out_len = 4, 2, 6
    stdout = run(["benchmarks/probes/mixed_step_profile.py", "--device", "cpu", "--arms", "none,fixed:3",
                  "--concurrency", str(conc), "--waves", str(waves), "--output-len", str(out_len),
                  "--prompt-len", "10",
                  "--shape-overrides", json.dumps(MICRO)], tmp_path, OUT=str(tmp_path / "out"))
    assert "none @ 4:" in stdout and "fixed:3 @ 4:" in stdout
    d = json.loads((tmp_path / "out" / "mixed_step_profile.json").read_text())
    assert d["synthetic_acceptance"] == "timing only" and d["device"] == "cpu"
    assert [r["arm"] for r in d["rows"]] == ["none", "fixed:3"]
    for row in d["rows"]:
        timed, prof = row["timed"], row["profiled"]
        assert len(timed["host"]["gc"]["collections"]) == 3  # the collector's pauses, counted
        assert timed["total_output_tokens"] == conc * waves * out_len
        kinds = timed["step_kinds"]
        assert kinds["prefill"]["steps"] > 0 and kinds["decode"]["steps"] > 0
        assert kinds["prefill"]["tokens"] + kinds["decode"]["tokens"] == timed["total_output_tokens"]
        # every step call of the profiled pass was classified, and each kind has a wall time
        assert prof["prefill"]["steps"] > 0 and prof["decode"]["steps"] > 0
        assert prof["prefill"]["wall_ms_per_step_profiled"] > 0
        # no GPU on the CPU path: nothing to tie to the steps, said as None rather than 0
        assert prof["decode"]["kernel_ms_per_step"] is None and prof["kernel_ms_total"] == 0.0
    text = (tmp_path / "out" / "mixed_step_profile.txt").read_text()
    assert text.count("---- host (cProfile by own time") == 2 and text.count("---- kernels") == 2
    assert "synthetic acceptance: timing only" in text.splitlines()[0]


def _event(name, device, start, end, id=0, stream=7):
    from types import SimpleNamespace

    import torch

    kind = torch.autograd.DeviceType.CPU if device == "cpu" else torch.autograd.DeviceType.CUDA
    return SimpleNamespace(name=name, device_type=kind, id=id, device_index=0, thread=stream,
                           time_range=SimpleNamespace(start=start, end=end))


def test_gpu_work_is_tied_to_the_step_call_that_launched_it():
    """mixed_step_profile.step_kernel_us: each GPU activity goes to the step whose GPU-side range on
    the same stream began last before it, matched to the step calls by id: a pipelined step's
    kernels queued behind the previous step's still count as its own; work on a stream with no
    step range is reported as not tied."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    from mixed_step_profile import STEP, step_kernel_us

    events = [
        # three step calls on the CPU (ids 11, 12, 13); the second launched nothing
        _event(STEP, "cpu", 0, 10, id=11), _event(STEP, "cpu", 10, 20, id=12), _event(STEP, "cpu", 20, 30, id=13),
        # their GPU-side ranges: step 11's work runs 5..25, step 13's 25..40
        _event(STEP, "gpu", 5, 25, id=11), _event(STEP, "gpu", 25, 40, id=13),
        _event("gemm", "gpu", 5, 15), _event("attn", "gpu", 15, 25),  # step 11's (a graph replay, say)
        _event("gemm", "gpu", 25, 37), _event("copy", "gpu", 37, 40),  # step 13's
        _event("early", "gpu", 1, 3),  # before any step's range
        _event("other", "gpu", 6, 8, stream=9),  # a stream no step range covers
        _event("aten::mm", "cpu", 2, 4),  # CPU ops are not GPU work
    ]
    per_step, loose = step_kernel_us(events, 3)
    assert per_step == [20.0, 0.0, 15.0] and loose == 4.0
    # GPU ranges whose ids match no step call, one per call on their stream: matched by order
    renamed = [_event(STEP, "gpu", 5, 25, id=91), _event(STEP, "gpu", 25, 30, id=92),
               _event(STEP, "gpu", 30, 40, id=93)]
    base = [e for e in events if not (e.name == STEP and e.device_type.name == "CUDA")]
    per_step, _ = step_kernel_us(base + renamed, 3)
    assert per_step == [20.0, 12.0, 3.0]
    # neither matched by id nor one per call: not tied at all, said so
    assert step_kernel_us(base + renamed[:2], 3) == (None, 39)  # every activity: 10 + 10 + 12 + 3 + 2 + 2


def test_kernels_are_ranked_by_time_per_step_of_one_kind():
    """mixed_step_profile.top_kernels_per_step: each kind's activities by name, summed over that
    kind's steps only and divided by their count (ms), costliest first."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    from mixed_step_profile import STEP, step_kernel_us, top_kernels_per_step

    events = [
        _event(STEP, "cpu", 0, 10, id=1), _event(STEP, "cpu", 10, 20, id=2), _event(STEP, "cpu", 20, 30, id=3),
        _event(STEP, "gpu", 0, 10, id=1), _event(STEP, "gpu", 10, 20, id=2), _event(STEP, "gpu", 20, 30, id=3),
        _event("gemm", "gpu", 0, 4), _event("ctx", "gpu", 4, 10),  # step 1 (a chunk step)
        _event("gemm", "gpu", 10, 19),  # step 2 (decode)
        _event("gemm", "gpu", 20, 28), _event("copy", "gpu", 28, 30),  # step 3 (a chunk step)
    ]
    tied: list = []
    per_step, loose = step_kernel_us(events, 3, tied)
    assert per_step == [10.0, 9.0, 10.0] and loose == 0.0 and len(tied) == 5
    kinds = ["prefill", "decode", "prefill"]
    # prefill: gemm (4 + 8) / 2 = 6 us, ctx 6 / 2 = 3, copy 2 / 2 = 1; the decode step's gemm left out
    assert top_kernels_per_step(tied, kinds, "prefill") == [("gemm", 0.006), ("ctx", 0.003), ("copy", 0.001)]
    assert top_kernels_per_step(tied, kinds, "decode") == [("gemm", 0.009)]
    assert top_kernels_per_step(tied, kinds, "prefill", n=1) == [("gemm", 0.006)]
    assert top_kernels_per_step(tied, ["decode"] * 3, "prefill") == []


def test_mixed_step_profile_refuses_an_empty_workload_by_name(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/probes/mixed_step_profile.py", "--device", "cpu", "--waves", "0"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--waves must be at least 1, got 0" in r.stderr


def test_first_request_stall_probe_alternates_its_repeats(tmp_path):
    shape = json.dumps({**MICRO, "max_position_embeddings": 2048})
    stdout = run(["benchmarks/probes/first_request_stall.py", "--arms", "none", "--repeats", "2", "--output-len", "4",
                  "--shape-overrides", shape], tmp_path, OUT=str(tmp_path / "out"))
    d = json.loads((tmp_path / "out" / "first_request_stall.json").read_text())
    assert [(r["warm_up_requests"], r["repeat"]) for r in d] == [(False, 0), (True, 0), (True, 1), (False, 1)]
    for r in d:
        assert list(r["phases"]) == ["bench warm-up", "first point", "second point"]
        assert (r["warm_up"] is not None) == r["warm_up_requests"]
    assert "none warm_up_requests=True (repeat 1)" in stdout


def test_selfdistill_backend_probe_on_the_micro_preset(tmp_path):
    """benchmarks/probes/selfdistill_backend.py: both attention backends, both orders, both
    temperatures, and the greedy rows compared (on the CPU "auto" is the reference backend)."""
    stdout = run(["benchmarks/probes/selfdistill_backend.py", "--preset", "micro", "--rows", "6", "--gen", "3",
                  "--vocab", "512"], tmp_path, OUT=str(tmp_path / "out"))
    d = json.loads((tmp_path / "out" / "selfdistill_backend.json").read_text())
    assert [(r["backend"], r["temperature"]) for r in d["runs"]] == [
        ("reference", 1.0), ("reference", 0.0), ("auto", 1.0), ("auto", 0.0),
        ("auto", 1.0), ("auto", 0.0), ("reference", 1.0), ("reference", 0.0)]
    assert d["greedy_rows_equal"] == 6 and all(r["ms_per_step"] > 0 for r in d["runs"])
    assert "greedy rows equal: 6 of 6" in stdout


def test_cost_table_stability_probe_on_the_micro_preset(tmp_path):
    """benchmarks/probes/cost_table_stability.py: the verify table profiled by both methods,
    alternating, on a random-weight target with the synthetic stand-in drafter."""
    stdout = run(["benchmarks/probes/cost_table_stability.py", "--preset", "micro", "--vocab", "512",
                  "--max-num-seqs", "2", "--profiles", "2", "--repeats", "1"], tmp_path, OUT=str(tmp_path / "out"))
    d = json.loads((tmp_path / "out" / "cost_table_stability.json").read_text())
    assert d["sizes"] == [1, 2, 3, 4, 6, 8, 12, 16]  # 2 requests of k + 1 = 8 tokens
    for method in ("shape after shape", "rounds"):
        tables = d["tables"][method]
        assert len(tables) == 2 and all(len(t) == 8 and t == sorted(t) for t in tables)  # forced monotone
        s = d["summary"][method]
        assert (s["rise_from_tokens"], s["rise_to_tokens"]) == (1, 16) and len(s["rise_ms"]) == 2
        assert 0 <= s["median_spread_ms"] <= s["max_spread_ms"]
    assert "rounds: spread over profiles max" in stdout


def test_drafter_step_variants_probe_on_the_micro_preset(tmp_path):
    """benchmarks/probes/drafter_step_variants.py: the loop's own step per variant from the same
    weights (same first loss, else it stops), timed in the order ABBA."""
    stdout = run(["benchmarks/probes/drafter_step_variants.py", "--preset", "micro", "--vocab", "512",
                  "--variants", "recipe,fused", "--steps", "2", "--warmup", "1"], tmp_path, OUT=str(tmp_path / "out"))
    d = json.loads((tmp_path / "out" / "drafter_step_variants.json").read_text())
    assert d["order"] == ["recipe", "fused", "fused", "recipe"]
    rows = {r["variant"]: r for r in d["variants"]}
    assert (rows["recipe"]["adamw_impl"], rows["fused"]["adamw_impl"]) == ("foreach", "fused")
    assert rows["recipe"]["first_loss"] == rows["fused"]["first_loss"]  # one batch, the same start
    assert all(len(r["wall_ms_per_step"]) == 2 and r["steps_in_budget"] > 0 for r in rows.values())
    assert "variant" in stdout and "wall ms/step" in stdout


def test_gpu_bisect_runs_the_tests_on_each_patched_version(tmp_path):
    """benchmarks/gpu_bisect.sh run: the test runs on this checkout and on a copy per patch, each
    importing its own adaspec/ (a patch that adds a module: the test fails on the checkout, passes
    on the patched copy), and a patch that does not apply is reported, not fatal."""
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "01_adds.patch").write_text(
        "--- /dev/null\n+++ b/adaspec/_bisect_marker.py\n@@ -0,0 +1 @@\n+VALUE = 41\n")
    (patches / "02_broken.patch").write_text(
        "--- a/adaspec/no_such_file.py\n+++ b/adaspec/no_such_file.py\n@@ -1 +1 @@\n-x\n+y\n")
    test = tmp_path / "t" / "test_marker.py"
    test.parent.mkdir()
    test.write_text("def test_marker():\n    from adaspec._bisect_marker import VALUE\n    assert VALUE == 41\n")
    out = tmp_path / "out"
    r = subprocess.run(["bash", "benchmarks/gpu_bisect.sh", "run", str(patches), str(out), "--", "-q",
                        "-p", "no:cacheprovider", str(test)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHON": sys.executable,
                                         "BISECT_WORK": str(tmp_path / "work")})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (out / "bisect.txt").read_text().splitlines()
    assert lines[0].startswith("HEAD: rc=1") and "failed" in lines[0]
    assert lines[1].startswith("01_adds: rc=0") and "1 passed" in lines[1]
    assert lines[2].startswith("02_broken: the patch did not apply")
    assert not (ROOT / "adaspec" / "_bisect_marker.py").exists()  # the checkout itself is untouched


def test_gpu_bisect_without_patches_stops_before_any_test(tmp_path):
    (tmp_path / "patches").mkdir()
    out = tmp_path / "out"
    r = subprocess.run(["bash", "benchmarks/gpu_bisect.sh", "run", str(tmp_path / "patches"), str(out), "--", "-q"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no patches in" in r.stderr
    assert not out.exists()  # nothing ran, not even the checkout's own tests


def test_penalties_bench_times_both_paths_on_the_same_inputs(tmp_path):
    """benchmarks/penalties_bench.py: the sparse (CPU) and dense (CUDA) penalties alternated, each
    round's time printed, and the check that they give the same floats."""
    stdout = run(["benchmarks/penalties_bench.py", "--requests", "3", "--positions", "4", "--vocab", "96",
                  "--calls", "2", "--rounds", "2"], tmp_path)
    assert "12 rows (3 requests x 4 positions), V = 96" in stdout
    lines = [line for line in stdout.splitlines() if "median" in line]
    assert len(lines) == 2 and all(len(line.split()) >= 6 for line in lines)
    assert "same floats both ways: True" in stdout


def test_kv_write_inplace_probe_compiles_one_graph_for_every_layer(tmp_path):
    """benchmarks/probes/kv_write_inplace_probe.py on the CPU (inductor's C++ backend): a time per
    layer for each cache size, the keys found in the cache itself, one graph for all layers."""
    stdout = run(["benchmarks/probes/kv_write_inplace_probe.py", "--slots", "96,4096", "--layers", "2",
                  "--calls", "2", "--device", "cpu"], tmp_path)
    assert "96 slots" in stdout and "4096 slots" in stdout  # (64 would share a symbol with head_dim 64)
    assert "'unique_graphs': 1" in stdout


def test_draft_temperature_probe_on_the_tiny_pair(tmp_path):
    """benchmarks/probes/draft_temperature_probe.py: one line per draft temperature factor, each
    with k acceptances in [0, 1] and an expected length in [1, k + 1]; T = 0 refused."""
    stdout = run(["benchmarks/probes/draft_temperature_probe.py", "--prompts", "3", "--gen-len", "16",
                  "--factors", "0.8,1"], tmp_path)
    lines = [line.split() for line in stdout.splitlines() if line.strip().startswith("t =")]
    assert [line[2] for line in lines] == ["0.8", "1"]
    for line in lines:
        slots = [float(x) for x in line[6:13]]
        assert len(slots) == 7 and all(0 <= a <= 1 for a in slots)
        assert 1 <= float(line[-1]) <= 8
    r = subprocess.run([sys.executable, "benchmarks/probes/draft_temperature_probe.py", "--temperature", "0"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--temperature must be > 0" in r.stderr


def test_engine_ref_cycle_probe_names_a_cycles_edges_and_finds_none_in_a_cpu_engine(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    try:
        from engine_ref_cycle import _edge_name, find_cycle
    finally:
        sys.path.pop(0)

    class Engine:
        pass

    class Runner:
        pass

    def build():
        engine, runner = Engine(), Runner()
        runner.callback = lambda: engine
        engine.runner = runner
        return engine

    engine = build()
    path = find_cycle(engine, set())
    assert path[0] is engine and path[-1] is engine
    edges = [_edge_name(a, b) for a, b in zip(path, path[1:])]
    assert edges[:2] == [".runner", ".callback"] and ".cell_contents" in edges
    assert find_cycle(engine, {id(path[-2])}) is None  # with the cell that points back banned
    assert find_cycle(Engine(), set()) is None
    stdout = run(["benchmarks/probes/engine_ref_cycle.py", "--device", "cpu", "--spec", "plain"], tmp_path)
    assert "== plain on cpu: engine freed" in stdout and "after a collection: freed" in stdout


def test_engine_ref_cycle_probe_refuses_an_unknown_engine_kind_by_name(tmp_path):
    r = subprocess.run([sys.executable, "benchmarks/probes/engine_ref_cycle.py", "--device", "cpu",
                        "--spec", "plain,adaspec"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown engine kind(s) 'adaspec'; choose from plain, adaptive" in r.stderr
    assert "Traceback" not in r.stderr


def test_draft_width_cost_times_every_width_at_every_request_count(tmp_path):
    stdout = run(["benchmarks/probes/draft_width_cost.py", "--device", "cpu", "--requests", "1,3", "--widths", "2",
                  "--k", "4", "--repeats", "1", "--shape-overrides", json.dumps(MICRO)], tmp_path,
                 OUT=str(tmp_path / "out"))
    assert "3 requests: 2 slots" in stdout and "4 slots" in stdout
    d = json.loads((tmp_path / "out" / "draft_width_cost.json").read_text())
    assert d["k"] == 4 and d["device"] == "cpu" and d["graphed"] is False
    assert [r["requests"] for r in d["rows"]] == [1, 3]
    assert all(set(r["ms"]) == {"2", "4"} and all(v > 0 for v in r["ms"].values()) for r in d["rows"])
