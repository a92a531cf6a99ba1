"""ADASPEC_LOG_SLOW_STEPS_MS (engine/slow_steps.py): a log line for each slow step, with its shape
and what compiled or collected garbage during it. Timed with fake clocks only."""
import gc
import itertools
import logging

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.engine import llm_engine
from adaspec.engine.scheduler import ScheduledSeq
from adaspec.engine.sequence import Sequence
from adaspec.engine.slow_steps import ENV, SlowStepLog, step_shape, threshold_from_env
from adaspec.errors import ConfigError


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_threshold_from_env():
    assert threshold_from_env({}) is None
    assert threshold_from_env({ENV: " "}) is None
    assert threshold_from_env({ENV: "50"}) == 50.0
    assert threshold_from_env({ENV: "0"}) == 0.0
    for bad in ("fast", "-1", "nan"):
        with pytest.raises(ConfigError, match=ENV):
            threshold_from_env({ENV: bad})


def test_only_steps_over_the_threshold_are_logged_with_what_happened_during_them(caplog):
    clock = Clock()
    watch = SlowStepLog(20.0, logging.getLogger("test.slow"), clock=clock).install()
    try:
        with caplog.at_level(logging.WARNING, logger="test.slow"):
            watch.begin()
            clock.t += 0.019
            assert watch.end("fast step") is None
            watch.begin()
            watch.note_triton_compile("_paged_attention_kernel")
            watch.note_triton_compile("_paged_attention_kernel")
            watch.note_triton_compile("_merge_splits_kernel")
            gc.collect()
            clock.t += 0.7
            line = watch.end("3 requests: 1 prefill rows of 200 tokens, 2 decodes")
            # the next step starts from nothing: the kernels above belong to the slow step only
            watch.begin()
            clock.t += 0.05
            quiet = watch.end("2 requests: 0 prefill rows of 0 tokens, 2 decodes")
    finally:
        watch.uninstall()
    assert line is not None and "700.0 ms (threshold 20 ms)" in line
    assert "1 prefill rows of 200 tokens" in line
    assert "Triton kernels compiled: _merge_splits_kernel, _paged_attention_kernel x2" in line
    assert "garbage collections: 1 (" in line
    assert quiet is not None and "no compile or garbage collection" in quiet and "Triton" not in quiet
    assert [r.getMessage() for r in caplog.records] == [line, quiet]
    assert watch.num_logged == 2
    assert watch._on_gc not in gc.callbacks


def test_step_shape_counts_prefill_rows_decodes_and_draft_slots():
    def seq(computed, generated=0):
        s = Sequence("r", None, list(range(1, 31)), SamplingParams(max_tokens=4))
        s.token_ids += [7] * generated
        s.num_computed_tokens = computed
        return s

    rows = [ScheduledSeq(seq(0), 16),  # a first chunk: does not sample
            ScheduledSeq(seq(16), 14),  # the last chunk
            ScheduledSeq(seq(30, 1), 1, spec_slots=7),  # a decode with 7 draft slots
            ScheduledSeq(seq(31, 2), 1, spec_slots=3)]
    assert step_shape(rows) == "4 requests: 2 prefill rows of 30 tokens, 2 decodes, 10 draft slots"
    assert step_shape(rows[:2]) == "2 requests: 2 prefill rows of 30 tokens, 0 decodes"


def _generate(micro_qwen3):
    llm = LLM(str(micro_qwen3), max_num_seqs=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 17, 30)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    return llm.llm_engine


def test_the_engine_logs_every_step_slower_than_the_threshold(micro_qwen3, monkeypatch, caplog):
    ticks = itertools.count()
    monkeypatch.setattr(llm_engine, "step_clock", lambda: float(next(ticks)))  # 1 s per reading
    monkeypatch.setenv(ENV, "500")
    with caplog.at_level(logging.WARNING, logger="adaspec.engine"):
        eng = _generate(micro_qwen3)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow engine step")]
    try:
        # the engine reads its clock for time_in_steps too: every step spans >= 1 s of fake time
        assert len(lines) == eng._slow_steps.num_logged >= eng.stats.num_steps > 0
        assert "3 requests: 3 prefill rows of 52 tokens, 0 decodes" in lines[0]
        assert any("3 requests: 0 prefill rows of 0 tokens, 3 decodes" in line for line in lines)
    finally:
        eng._slow_steps.uninstall()


def test_the_engine_logs_nothing_below_the_threshold_or_when_unset(micro_qwen3, monkeypatch, caplog):
    monkeypatch.setattr(llm_engine, "step_clock", lambda: 0.0)
    monkeypatch.setenv(ENV, "500")
    with caplog.at_level(logging.WARNING, logger="adaspec.engine"):
        eng = _generate(micro_qwen3)
        eng._slow_steps.uninstall()
        monkeypatch.delenv(ENV)
        assert _generate(micro_qwen3)._slow_steps is None
    assert eng._slow_steps.num_logged == 0
    assert not [r for r in caplog.records if "slow engine step" in r.getMessage()]


def test_the_triton_hook_counts_compiled_kernels_and_is_restored(caplog):
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no post-compile hook")
    from types import SimpleNamespace

    before = knobs.runtime.jit_post_compile_hook
    clock = Clock()
    watch = SlowStepLog(1.0, logging.getLogger("test.slow"), clock=clock).install()
    try:
        assert knobs.runtime.jit_post_compile_hook == watch._on_triton_compile
        watch.begin()
        # what Triton's JITFunction._call_hook passes after compiling a new specialization
        knobs.runtime.jit_post_compile_hook(key=("k",), repr="_paged_attention_kernel[num_warps=4](num_seqs: i32)",
                                            fn=SimpleNamespace(name="_paged_attention_kernel"), compile={},
                                            is_manual_warmup=False, already_compiled=False)
        clock.t += 1.0
        line = watch.end("a step")
    finally:
        watch.uninstall()
    assert knobs.runtime.jit_post_compile_hook is before
    assert "Triton kernels compiled: _paged_attention_kernel" in line
    assert "variants: _paged_attention_kernel[num_warps=4](num_seqs: i32)" in line


def test_a_torch_compile_recompile_during_a_step_is_reported(caplog):
    """A function compiled with dynamic shapes still specializes a size of 1: calling it with one
    row after several compiles again, inside the step (what stalled the H200's first requests)."""
    fn = torch.compile(lambda x: x * 2 + 1, dynamic=True, fullgraph=True, backend="eager")
    fn(torch.ones(5))
    clock = Clock()
    watch = SlowStepLog(1.0, logging.getLogger("test.slow"), clock=clock).install()
    try:
        watch.begin()
        fn(torch.ones(1))
        clock.t += 1.0
        line = watch.end("one row")
        watch.begin()
        fn(torch.ones(1))  # compiled now: nothing new
        clock.t += 1.0
        again = watch.end("one row again")
    finally:
        watch.uninstall()
    assert "torch.compile graphs compiled: 1" in line
    assert "torch.compile" not in again
