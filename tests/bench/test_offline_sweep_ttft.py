"""offline_sweep's helpers. TTFT counts from when a closed-loop client would have sent the request
(when a slot freed), not from the start of the point: queued at t0, request j >= C waits for the
(j - C)-th request to finish before it gets a slot. An arm swept alone is freed before the next loads."""
import contextlib
import sys
from pathlib import Path

import pytest

from adaspec.bench.checkpoint_id import checkpoints

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from offline_sweep import closed_loop_arrivals  # noqa: E402


@contextlib.contextmanager
def sweep_main_in_this_process():
    """Runs offline_sweep.main() in the test worker and puts back what main() changes there: the
    thread count (--threads), a frozen heap (--gc freeze) and the collector's pause counter."""
    import gc

    import offline_sweep
    import torch

    threads = torch.get_num_threads()
    try:
        yield offline_sweep
    finally:
        torch.set_num_threads(threads)
        gc.unfreeze()
        p = offline_sweep.GC_PAUSES
        if p.started:
            gc.callbacks.remove(p._callback)
            p.started = False


def test_first_c_at_start_then_each_when_a_slot_frees():
    # C = 2, five requests; finishes listed out of order: 3.0, 1.0, 2.0, 5.0, 4.0
    got = closed_loop_arrivals(10.0, [3.0, 1.0, 2.0, 5.0, 4.0], 5, 2)
    assert got == [10.0, 10.0, 1.0, 2.0, 3.0]


def test_one_client_sends_each_request_when_the_previous_finished():
    assert closed_loop_arrivals(0.0, [0.5, 1.0, 1.5], 3, 1) == [0.0, 0.5, 1.0]
    assert closed_loop_arrivals(0.0, [0.5, 1.0], 2, 8) == [0.0, 0.0]  # C above n: all at once


def test_host_load_per_point_from_two_samples():
    """The host record of a point: this process's CPU per wall second, the machine's busy CPUs
    (all processes) over the point, the load average at its end."""
    import os

    from offline_sweep import host_load, host_sample

    # 3 CPU s in 2 s of wall; the machine was busy 600 of 1000 jiffies; meanwhile 5 young and one
    # full collection, the full one a 120 ms pause
    gc0, gc1 = ((10, 2, 1), (0.01, 0.002, 0.1)), ((15, 2, 2), (0.0105, 0.002, 0.22))
    got = host_load((10.0, 400, 1000, 0.5, gc0), (13.0, 1000, 2000, 1.25, gc1), 2.0)
    assert got == {"process_cpu_per_wall": 1.5, "machine_busy_cpus": round(0.6 * (os.cpu_count() or 1), 2),
                   "loadavg_1m": 1.25, "gc": {"collections": [5, 0, 1], "ms": [0.5, 0.0, 120.0]}}
    assert host_load((0.0, None, None, None, gc0), (1.0, None, None, None, gc0), 1.0) == \
        {"process_cpu_per_wall": 1.0, "machine_busy_cpus": None, "loadavg_1m": None,
         "gc": {"collections": [0, 0, 0], "ms": [0.0, 0.0, 0.0]}}
    assert host_load((0.0, None, None, None, None), (1.0, None, None, None, None), 1.0)["gc"] is None  # not counted
    a = host_sample()
    sum(i * i for i in range(200_000))  # some CPU work of this process
    b = host_sample()
    assert b[0] > a[0] and (a[1] is None or (b[2] >= a[2] and b[1] >= a[1]))


def test_the_collectors_pauses_are_counted_per_generation():
    import gc

    from offline_sweep import GcPauses

    pauses = GcPauses()
    assert pauses.sample() is None and GcPauses.since(None, None) is None  # not started: nothing claimed
    pauses.start()
    pauses.start()
    assert gc.callbacks.count(pauses._callback) == 1  # installed once
    a = pauses.sample()
    gc.collect()  # one full collection
    gc.collect(0)
    try:
        got = GcPauses.since(a, pauses.sample())
    finally:
        gc.callbacks.remove(pauses._callback)
    assert pauses._callback not in gc.callbacks
    assert got["collections"][2] == 1 and got["collections"][0] >= 1
    assert got["ms"][2] > 0 and got["ms"][0] >= 0  # a full collection of a process with torch loaded takes time


def test_the_startup_heap_is_frozen_while_each_arm_is_measured(monkeypatch):
    """--gc freeze: the loaded engine is out of the collector's reach during its points, and back in
    it before it is freed (frozen objects are never collected: the next arm would find it alive)."""
    import gc
    import weakref

    from offline_sweep import sweep_arms_one_at_a_time

    class Llm:
        def __init__(self):
            self.llm_engine = self  # a cycle, as the real engine has

    alive, frozen = [], []

    def load(arm):
        assert all(ref() is None for ref in alive), f"{arm}: an earlier arm's engine is still alive"
        llm = Llm()
        alive.append(weakref.ref(llm))
        return (llm,)

    try:
        # the engine itself is out of reach (get_objects lists only the collector's generations)
        measured = lambda arm, llm: frozen.append(not any(o is llm for o in gc.get_objects()))
        sweep_arms_one_at_a_time(["a", "b"], load, measured, freeze=True)
        assert gc.get_freeze_count() == 0
        with pytest.raises(RuntimeError):  # a failing arm leaves nothing frozen behind
            sweep_arms_one_at_a_time(["c"], load, lambda arm, llm: (_ for _ in ()).throw(RuntimeError("x")),
                                     freeze=True)
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
    assert frozen == [True, True]
    assert all(ref() is None for ref in alive[:2])


def test_each_arm_engine_is_freed_before_the_next_arm_loads():
    # an engine in a reference cycle, as the real one is: only a collection frees it
    import gc
    import weakref

    from offline_sweep import sweep_arms_one_at_a_time

    class Engine:
        def __init__(self):
            self.me, self.calls = self, []

        def release_cuda_graphs(self):
            self.calls.append("graphs")

        def shutdown(self):
            self.calls.append("shutdown")

    class Llm:
        def __init__(self):
            self.llm_engine = Engine()

    alive, measured, calls = [], [], []

    def load(arm):
        gc.disable()  # no collection by chance between the arms: the sweep must do it
        assert all(ref() is None for ref in alive), f"{arm}: an earlier arm's engine is still alive"
        llm = Llm()
        alive.append(weakref.ref(llm.llm_engine))
        calls.append(llm.llm_engine.calls)
        return llm, f"label-{arm}"

    try:
        sweep_arms_one_at_a_time(["a", "b", "c"], load, lambda arm, llm, label: measured.append((arm, label)))
    finally:
        gc.enable()
    assert measured == [("a", "label-a"), ("b", "label-b"), ("c", "label-c")]
    assert calls == [["graphs", "shutdown"]] * 3
    assert all(ref() is None for ref in alive)


def test_run_point_gives_each_prompt_its_own_length():
    """--random-range-ratio: run_point takes one SamplingParams per prompt (the point's lengths)."""
    from offline_sweep import run_point

    from adaspec import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", max_num_seqs=2)
    lengths = [3, 5, 7]
    res = run_point(llm, [[5, 6, 7], [8, 9], [10, 11, 12]],
                    [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert res["total_output_tokens"] == sum(lengths)
    assert res["preemptions"] == 0


def test_a_point_records_the_preemptions_a_small_kv_cache_forced():
    """Each row says how many requests the point preempted, so a sweep whose KV cache was shrunk to
    fit several engines shows whether it recomputed any."""
    from offline_sweep import run_point

    from adaspec import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", max_num_seqs=4, block_size=16, num_kv_blocks=6, max_model_len=96)
    res = run_point(llm, [[5, 6, 7]] * 4, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert res["total_output_tokens"] == 160
    assert res["preemptions"] == llm.llm_engine.stats.num_preemptions > 0


def test_step_trace_records_every_step_and_adds_up_to_the_point():
    """--step-trace: one row per step call, whose tokens sum to the point's and whose prompt tokens
    are the prompts' (no recompute here), with the drafted rows of an adaptive arm counted."""
    from offline_sweep import StepKinds, run_point

    from adaspec import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", max_num_seqs=3, max_num_batched_tokens=64,
              speculative_config={"method": "dspark", "model": "tiny-dspark", "num_speculative_tokens": 3,
                                  "enable_adaptive_verification": True})
    prompts = [list(range(5, 5 + n)) for n in (40, 30, 50, 20)]
    res = run_point(llm, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), trace=True)
    trace, fields = res["step_trace"], StepKinds.TRACE_FIELDS
    assert trace and all(len(row) == len(fields) for row in trace)
    col = {name: [row[i] for row in trace] for i, name in enumerate(fields)}
    assert sum(col["generated_tokens"]) == res["total_output_tokens"] == 24
    assert sum(col["prompt_tokens"]) == sum(map(len, prompts))  # the 64-token budget split the prompts into chunks
    assert max(col["prompt_tokens"]) <= 64 and sum(p > 0 for p in col["prompt_tokens"]) >= 3
    assert col["waiting"][0] == 4 and col["running"][0] == 0  # counted before the first step ran
    assert all(ms >= 0 for ms in col["wall_ms"])
    assert len(trace) == res["step_kinds"]["prefill"]["steps"] + res["step_kinds"]["decode"]["steps"]
    stats = llm.llm_engine.stats
    assert stats.num_drafts > 0 and sum(col["drafted_rows"]) == stats.num_drafts and sum(col["verified_drafts"]) == stats.num_verified_tokens
    assert sum(col["draft_skipped"]) == stats.num_steps_draft_skipped
    assert "step_trace" not in run_point(llm, prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))


def test_a_bad_range_ratio_stops_the_sweep_before_any_engine_loads():
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "benchmarks/offline_sweep.py", "--model", "tiny", "--random-range-ratio", "1"],
                         cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 2 and "--random-range-ratio must be in [0, 1), got 1.0" in run.stderr


def test_the_collector_callback_keeps_its_own_clock(monkeypatch):
    """A test that fakes time.perf_counter (a fixed list of ticks) must not have them eaten by the
    collector's callback of a sweep module imported earlier in the same process: CI once crashed
    that way (a tick iterator ran dry inside a collection that pytest's own parser triggered)."""
    import gc
    import time

    from offline_sweep import GcPauses

    pauses = GcPauses()
    pauses.start()
    ticks = iter([1.0, 2.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    try:
        gc.collect()
        gc.collect()
    finally:
        gc.callbacks.remove(pauses._callback)
    assert next(ticks) == 1.0  # untouched
    assert pauses.collections[2] == 2 and pauses.seconds[2] > 0


def test_an_interleaved_sweep_measures_with_the_startup_heap_frozen(monkeypatch, tmp_path):
    """The interleaved path of main(): every point runs with what start-up built frozen (--gc
    freeze, the default), the heap is unfrozen once the sweep ends, and each point records the
    collector's pauses; --gc as-is leaves the collector alone."""
    import gc
    import json

    import offline_sweep

    frozen = []
    run_point = offline_sweep.run_point

    def spy(*a, **kw):
        frozen.append(gc.get_freeze_count() > 0)
        return run_point(*a, **kw)

    monkeypatch.setattr(offline_sweep, "run_point", spy)
    with sweep_main_in_this_process():
        for mode in ("freeze", "as-is"):
            out = tmp_path / f"{mode}.json"
            monkeypatch.setattr(sys, "argv", [
                "offline_sweep.py", "--model", "tiny", "--arms", "none,fixed:2", "--concurrency", "2",
                "--num-prompts", "2", "--output-len", "3", "--repeats", "1", "--device", "cpu", "--threads", "1",
                "--interleave", "--gc", mode, "--out", str(out)])
            frozen.clear()
            offline_sweep.main()
            assert gc.get_freeze_count() == 0  # nothing left frozen after the sweep
            # warm-up and measured point per arm, every one frozen or none
            assert frozen == [mode == "freeze"] * 4
            d = json.loads(out.read_text())
            assert d["args"]["gc"] == mode
            # which weights: the embedded pair's files (the drafter by default for the tiny target)
            assert d["checkpoints"] == checkpoints("tiny", "tiny-dspark") and all(d["checkpoints"].values())
            assert all(len(r["host"]["gc"]["collections"]) == 3 for r in d["rows"])


def test_host_speed_is_none_over_an_older_tree_without_it(monkeypatch):
    """h200_ab_synthetic.sh runs this script over older trees' engines, which lack
    adaspec.bench.conditions: the sweep's host speed, per run and per point, is then None."""
    import offline_sweep

    assert offline_sweep.host_loop_ms() > 0  # this tree has it
    monkeypatch.setitem(sys.modules, "adaspec.bench.conditions", None)  # an import of it now fails
    assert offline_sweep.host_speed() is None
    assert offline_sweep.host_loop_ms() is None


def test_interleaved_engines_share_what_the_device_has_free():
    """Each interleaved engine gets the KV cache asked for while all of them fit in 60% of the
    free memory, less when they would not (H100 run 56: 5 x 16 GiB on an 80 GB card ran out of
    memory), and a clear error when not even 0.5 GiB an engine fits."""
    from offline_sweep import engine_weight_bytes, interleaved_kv_gib

    gib = 2**30
    assert interleaved_kv_gib(16, 4, 139 * gib) == 16  # the H200: 4 x 16 fits
    assert interleaved_kv_gib(16, 5, 78 * gib) == 9.0  # 0.6 * 78 / 5 = 9.36, rounded down to 0.5
    assert interleaved_kv_gib(10, 4, 78 * gib) == 10
    assert interleaved_kv_gib(16, 1, 78 * gib) == 16
    with pytest.raises(SystemExit, match="do not fit"):
        interleaved_kv_gib(16, 8, 4 * gib)
    with pytest.raises(SystemExit, match="positive"):
        interleaved_kv_gib(0, 4, 78 * gib)
    # each engine's weights come out of its share: three Qwen3-8B engines (15.3 GiB each) on an
    # 80 GB card do not fit (H100 run 74 ran out of memory with 15.5 GiB of cache each), two do
    eight_b = engine_weight_bytes("qwen3-8b", "unused", None)
    assert eight_b == 2 * 8_190_735_360  # bf16
    with pytest.raises(SystemExit, match="15.3 GiB of weights"):
        interleaved_kv_gib(20, 3, 78 * gib, eight_b)  # 0.6 * 78 / 3 - 15.26 = 0.34
    assert interleaved_kv_gib(20, 2, 79 * gib, eight_b) == 8.0  # 0.6 * 79 / 2 - 15.26 = 8.44, rounded down


def test_an_engines_weights_are_its_safetensors_files(tmp_path):
    from offline_sweep import engine_weight_bytes

    target, drafter = tmp_path / "t", tmp_path / "d"
    target.mkdir(), drafter.mkdir()
    (target / "model-00001-of-00002.safetensors").write_bytes(b"x" * 3000)
    (target / "model-00002-of-00002.safetensors").write_bytes(b"x" * 1000)
    (target / "config.json").write_text("{}")  # not weights
    (drafter / "model.safetensors").write_bytes(b"x" * 500)
    assert engine_weight_bytes(None, str(target), str(drafter)) == 4500
    assert engine_weight_bytes(None, str(target), None) == 4000
    assert engine_weight_bytes(None, "tiny", None) == 0  # an embedded name: not known here


def test_decode_only_steps_at_a_full_batch_are_counted_apart():
    """step_kinds' decode_full_batch: the decode-only steps that began with max_num_seqs requests
    running, a subset of decode. Two requests of one length at max_num_seqs 2 fill every decode
    step to its last; one request alone fills none."""
    from offline_sweep import run_point

    from adaspec import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    both = run_point(llm, [[5, 6, 7], [8, 9, 10]], params)["step_kinds"]
    assert both["decode"]["steps"] > 0 and both["decode_full_batch"]["steps"] == both["decode"]["steps"]
    assert both["decode_full_batch"]["tokens"] == both["decode"]["tokens"]
    alone = run_point(llm, [[5, 6, 7]], params)["step_kinds"]
    assert alone["decode"]["steps"] > 0 and alone["decode_full_batch"] == dict(
        steps=0, ms_per_step=None, tokens=0, tokens_per_ms=None)
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    staggered = run_point(llm, [[5, 6, 7], [8, 9], [10, 11, 12]], lengths)["step_kinds"]
    assert 0 < staggered["decode_full_batch"]["steps"] < staggered["decode"]["steps"]


def test_range_ratios_are_one_or_several_each_checked():
    from offline_sweep import parse_range_ratios

    assert parse_range_ratios("0") == [0.0] and parse_range_ratios("0.5") == [0.5]
    assert parse_range_ratios("0,0.5") == [0.0, 0.5] and parse_range_ratios(" 0.5 , 0") == [0.5, 0.0]
    with pytest.raises(ValueError, match=r"must be in \[0, 1\), got 1.0"):
        parse_range_ratios("0,1")
    with pytest.raises(ValueError, match="comma-separated; got 'x'"):
        parse_range_ratios("0.5,x")
    with pytest.raises(ValueError, match="twice"):
        parse_range_ratios("0.5,0.50")


def test_several_range_ratios_are_conditions_measured_with_the_same_engines(monkeypatch, tmp_path):
    """--random-range-ratio 0,0.5: every arm, concurrency and repeat is measured at each ratio by the
    engines loaded once, each row names its ratio and gets that ratio's lengths (the same prompts),
    and the summary has a line per ratio."""
    import json

    import offline_sweep

    loads = []
    real_load = offline_sweep.arm_config
    monkeypatch.setattr(offline_sweep, "arm_config", lambda *a, **kw: loads.append(a[0]) or real_load(*a, **kw))
    out = tmp_path / "sweep.json"
    monkeypatch.setattr(sys, "argv", [
        "offline_sweep.py", "--model", "tiny", "--arms", "none,fixed:2", "--concurrency", "2", "--num-prompts", "4",
        "--output-len", "8", "--random-range-ratio", "0,0.5", "--repeats", "2", "--device", "cpu", "--threads", "1",
        "--interleave", "--gc", "as-is", "--out", str(out)])
    with sweep_main_in_this_process():
        offline_sweep.main()
    assert sorted(loads) == ["fixed:2", "none"]  # one engine per arm for both conditions
    d = json.loads(out.read_text())
    assert d["args"]["random_range_ratio"] == [0.0, 0.5]
    assert {(r["arm"], r["repeat"], r["random_range_ratio"]) for r in d["rows"]} == {
        (a, rep, x) for a in ("none", "fixed:2") for rep in (0, 1) for x in (0.0, 0.5)}
    for r in d["rows"]:
        want = offline_sweep.output_lengths(4, 8, r["random_range_ratio"], seed=100_003 * r["repeat"] + 2)
        assert r["total_output_tokens"] == sum(want)
    spread = [r["total_output_tokens"] for r in d["rows"] if r["random_range_ratio"] == 0.5]
    assert spread != [32] * len(spread)  # the spread condition did spread the lengths
    assert [(s["arm"], s["random_range_ratio"]) for s in d["summary"]] == [
        ("none", 0.0), ("none", 0.5), ("fixed:2", 0.0), ("fixed:2", 0.5)]


def test_a_point_records_the_measured_overheads_state():
    """policy_overhead: the value priced, the signed average and the floored samples of an arm
    whose overhead is measured; None for a fixed overhead and for an engine without a policy."""
    from types import SimpleNamespace

    from offline_sweep import policy_overhead, policy_overhead_ms

    from adaspec.spec_decode.step_overhead import StepOverhead

    def engine(overhead):
        return SimpleNamespace(spec=SimpleNamespace(policy=SimpleNamespace(overhead=overhead)))

    measured = StepOverhead("measured", alpha=1.0)
    measured.observe(3.0, 5.0)
    assert policy_overhead(engine(measured)) == {"ms": 0.0, "signed_ms": -2.0, "samples": 1, "floored": 1,
                                                 "per_sample_floored_ms": 0.0}
    assert policy_overhead_ms(engine(measured)) == 0.0
    assert policy_overhead(engine(StepOverhead(1.5))) is None and policy_overhead_ms(engine(StepOverhead(1.5))) == 1.5
    assert policy_overhead(SimpleNamespace(spec=None)) is None
