"""The penalties' shared count rows (adaspec/sample/penalty_counts.py): kept up to date across
calls, grown without losing rows, and handed back and zeroed when a request is gone."""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaspec.sample.penalty_counts import PenaltyCounts

V = 17


class Holder:  # an engine Sequence's part that keeps state
    logits_rule_state = None


@dataclass
class Row:
    prompt: list[int]
    output: list[int]
    history: object = field(default_factory=Holder)


def expected(rows: list[Row], of_row: list[int]):
    counts = torch.zeros(len(of_row), V)
    in_prompt = torch.zeros(len(of_row), V, dtype=torch.bool)
    for n, h in enumerate(of_row):
        for t in rows[h].output:
            counts[n, t] += 1
        for t in rows[h].prompt:
            in_prompt[n, t] = True
    return counts, in_prompt


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, V - 1), max_size=6),
                          st.lists(st.lists(st.integers(0, V - 1), max_size=4), min_size=1, max_size=4)),
                min_size=1, max_size=12),
       st.integers(0, 3))
def test_counts_follow_histories_over_steps(requests, seed):
    """Requests whose outputs grow step by step (some leaving, some joining): every call's rows
    equal counts made from scratch."""
    pool = PenaltyCounts(V, "cpu")
    g = torch.Generator().manual_seed(seed)
    live = [Row(prompt, list(steps[0])) for prompt, steps in requests]
    steps = [list(s[1:]) for _, s in requests]
    while live:
        of_row = torch.randint(0, len(live), (len(live) + 2,), generator=g).tolist()
        counts, in_prompt = pool.rows(live, of_row)
        want = expected(live, of_row)
        assert torch.equal(counts, want[0]) and torch.equal(in_prompt, want[1])
        keep_rows, keep_steps = [], []
        for row, more in zip(live, steps):
            if more:
                row.output += more.pop(0)
                keep_rows.append(row)
                keep_steps.append(more)
        # the dropped rows' counts go back to the pool as their last reference goes (refcounting:
        # a Row holds no cycle), and the next call's fresh rows must come zeroed. (A gc.collect()
        # here cost ~0.3 s a call in a worker that had run hundreds of tests: 48 s of the suite.)
        live, steps = keep_rows, keep_steps


def test_a_finished_requests_row_is_zeroed_for_the_next():
    pool = PenaltyCounts(V, "cpu")
    a = Row([1, 2], [3, 3, 4])
    pool.rows([a], [0])
    slot = a.history.logits_rule_state.slot
    del a
    gc.collect()
    b = Row([5], [6])
    counts, in_prompt = pool.rows([b], [0])
    assert b.history.logits_rule_state.slot == slot  # the row came back and went to b
    assert counts[0].nonzero().flatten().tolist() == [6] and in_prompt[0].nonzero().flatten().tolist() == [5]


def test_growing_keeps_the_rows_already_counted():
    pool = PenaltyCounts(V, "cpu")
    first = [Row([i % V], [i % V, (i + 1) % V]) for i in range(5)]
    pool.rows(first, list(range(5)))
    more = first + [Row([], [i % V] * 2) for i in range(20)]  # past the first capacity of 8
    counts, in_prompt = pool.rows(more, list(range(len(more))))
    assert pool.capacity >= len(more)
    want = expected(more, list(range(len(more))))
    assert torch.equal(counts, want[0]) and torch.equal(in_prompt, want[1])


def test_rows_without_a_state_holder_are_lent_for_one_call():
    pool = PenaltyCounts(V, "cpu")
    rows = [Row([1], [2, 2], history=None), Row([], [3], history=None)]
    for _ in range(3):
        counts, _ = pool.rows(rows, [0, 1, 0])
        assert counts[:, 2].tolist() == [2.0, 0.0, 2.0]
    gc.collect()
    assert pool.capacity == 8  # the same two rows every call, not two more each time


def test_a_shrunk_history_is_counted_afresh():
    pool = PenaltyCounts(V, "cpu")
    a = Row([], [1, 1, 2])
    pool.rows([a], [0])
    a.output = [4]
    counts, _ = pool.rows([a], [0])
    assert counts[0].nonzero().flatten().tolist() == [4]


def test_a_steps_uploads_do_not_grow_with_the_penalized_requests(monkeypatch):
    """A step's host-to-device copies for the penalties are a fixed few, however many requests
    it penalizes (one each per request cost 0.05-0.09x the plain rate on an H100, H100 run 46)."""
    from adaspec.sample import logits_rules
    from adaspec.sample.logits_rules import LogitsRule, RuleRow, apply_logits_rules
    from adaspec.sampling_params import SamplingParams

    uploads = []
    from adaspec import h2d

    real = h2d.to_device
    monkeypatch.setattr(h2d, "to_device", lambda *a, **k: uploads.append(1) or real(*a, **k))
    monkeypatch.setattr(logits_rules, "to_device", h2d.to_device)
    rule = LogitsRule.of(SamplingParams(frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.2), set(), V)

    def step_uploads(n: int) -> int:
        rows = [RuleRow(rule, 1.0, [n % V], [1, 2, n % V], [3], history=Holder()) for n in range(n)]
        apply_logits_rules(torch.zeros(n, V), rows)  # first sight: prompts and outputs counted
        for r in rows:
            r.output.append(4)
        uploads.clear()
        apply_logits_rules(torch.zeros(n, V), rows)  # a later step: one new token each
        return len(uploads)

    assert step_uploads(2) == step_uploads(40) <= 4


def test_a_finished_requests_row_goes_back_while_its_sequence_is_still_held():
    """The engine drops a finished request's counts row (LLMEngine._finish), so the pool does not
    grow with finished Sequences something still holds: three waves of four penalized requests,
    every Sequence kept, leave no more rows held than before them."""
    from adaspec import LLM, SamplingParams
    from adaspec.sample.penalty_counts import pool_for
    from adaspec.testing import run_waves_keeping_sequences

    eng = LLM("tiny", max_num_seqs=4).llm_engine
    pool = pool_for(eng.model_config.vocab_size, eng.device)
    held_before = pool.capacity - len(pool._free)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, presence_penalty=0.5, ignore_eos=True)
    held = run_waves_keeping_sequences(eng, params)
    assert len(held) == 12
    assert all(s.finished and s.logits_rule_state is None for s in held)
    assert pool.capacity - len(pool._free) == held_before
