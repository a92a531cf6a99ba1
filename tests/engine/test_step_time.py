"""EngineStats.time_in_steps: the wall time inside step() only (the server exports it as
adaspec:engine_step_seconds, and `bench serve` divides it by a run's wall time), timed here with a
fake clock so that nothing depends on this machine's speed."""
import itertools

import torch

from adaspec import LLM, SamplingParams
from adaspec.engine import llm_engine


def test_time_in_steps_counts_the_time_inside_step_only(micro_qwen3, monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(llm_engine, "step_clock", lambda: float(next(ticks)))
    llm = LLM(str(micro_qwen3), max_num_seqs=4)
    eng = llm.llm_engine
    calls = 0
    inner = eng.step

    def step():
        nonlocal calls
        calls += 1
        next(ticks)  # a tick between steps, as the loop around them spends time: it must not count
        return inner()

    eng.step = step
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 12, 40)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    # every step() reads the clock twice, one tick apart: one second per call, none for the gaps
    assert calls >= eng.stats.num_steps > 0
    assert eng.stats.time_in_steps == calls
