"""SamplingParams.n > 1 (engine/parallel_sampling.py): n child requests, gathered back."""
from __future__ import annotations

import pytest

from adaspec import LLM, SamplingParams
from adaspec.engine.parallel_sampling import ParentRequest, child_params, child_request_id
from adaspec.errors import InvalidRequestError
from adaspec.outputs import CompletionOutput, RequestOutput
from adaspec.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind

ARGS = dict(device="cpu", max_model_len=256, num_kv_blocks=64, max_num_seqs=8)
PROMPTS = ["def fib(n):", "import os\n"]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", **ARGS)


def test_child_params_follow_vllm_seeds_and_wrap_at_64_bits():
    p = SamplingParams(n=3, seed=10, temperature=0.7)
    kids = [child_params(p, j) for j in range(3)]
    assert [(k.n, k.seed, k.temperature) for k in kids] == [(1, 10, 0.7), (1, 11, 0.7), (1, 12, 0.7)]
    assert p.n == 3 and p.seed == 10  # the parent's params are not touched
    assert child_params(SamplingParams(n=2, seed=SEED_MAX), 1).seed == SEED_MIN
    assert child_params(SamplingParams(n=2), 1).seed is None  # unseeded: each child draws its own
    assert child_request_id("r", 2) == "2_r"


def _out(rid, text, finished, t=None):
    return RequestOutput(rid, "p", [1], [CompletionOutput(0, text, [7], "length" if finished else None)],
                         finished, first_token_time=t)


def test_final_only_gathers_every_child_in_index_order():
    parent = ParentRequest("r", SamplingParams(n=3, output_kind=RequestOutputKind.FINAL_ONLY))
    assert parent.take(2, _out("2_r", "c", True, t=5.0)) is None
    assert parent.take(0, _out("0_r", "a", True, t=3.0)) is None
    got = parent.take(1, _out("1_r", "b", True, t=4.0))
    assert got.request_id == "r" and got.finished and got.first_token_time == 3.0
    assert [(c.index, c.text) for c in got.outputs] == [(0, "a"), (1, "b"), (2, "c")]


def test_streamed_kinds_pass_each_update_on_and_finish_with_the_last_child():
    parent = ParentRequest("r", SamplingParams(n=2, output_kind=RequestOutputKind.CUMULATIVE))
    a = parent.take(1, _out("1_r", "x", False))
    b = parent.take(1, _out("1_r", "xy", True))
    c = parent.take(0, _out("0_r", "z", True))
    assert [(o.outputs[0].index, o.outputs[0].text, o.finished) for o in (a, b, c)] == \
        [(1, "x", False), (1, "xy", False), (0, "z", True)]
    assert all(o.request_id == "r" and len(o.outputs) == 1 for o in (a, b, c))


@pytest.mark.parametrize("spec", [None, {"method": "dspark", "num_speculative_tokens": 3}])
def test_seeded_samples_equal_single_requests_with_seed_plus_index(spec):
    """n = 3 with seed s gives what three requests of one sample with seeds s, s + 1, s + 2 give
    (no speculation, and fixed k, whose seeded text does not depend on the batch)."""
    llm = LLM("tiny", speculative_config=spec, **ARGS)
    outs = llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5))
    assert [len(o.outputs) for o in outs] == [3, 3]
    for o, prompt in zip(outs, PROMPTS):
        assert [c.index for c in o.outputs] == [0, 1, 2] and o.finished
        singles = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, max_tokens=12, seed=5 + j)
                                              for j in range(3)])
        assert [c.text for c in o.outputs] == [s.outputs[0].text for s in singles]
        assert [c.token_ids for c in o.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({c.text for c in outs[0].outputs}) > 1  # the seeds differ, so the samples do
    assert not llm.llm_engine.parallel.parents and not llm.llm_engine.parallel.child_of


def test_unseeded_children_draw_distinct_seeds(llm):
    eng = llm.llm_engine
    eng.add_request("u", "x = ", SamplingParams(n=4, max_tokens=2))
    eng.step()  # seeds are drawn at the step
    seeds = {eng.requests[child_request_id("u", j)].seed for j in range(4) if child_request_id("u", j) in eng.requests}
    assert len(seeds) == 4
    while eng.has_unfinished_requests():
        eng.step()


def test_new_tokens_stream_adds_up_to_the_final_outputs(llm):
    eng = llm.llm_engine
    want = llm.generate(["x = 1\n"], SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3))[0]
    eng.add_request("s", "x = 1\n", SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3,
                                                   output_kind=RequestOutputKind.NEW_TOKENS))
    got, ends = {0: [], 1: []}, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "s" and len(o.outputs) == 1
            got[o.outputs[0].index] += o.outputs[0].token_ids
            ends.append(o.finished)
    assert [got[0], got[1]] == [c.token_ids for c in want.outputs]
    assert ends[-1] and not any(ends[:-1])  # finished once, with the last child


def test_aborting_the_parent_aborts_every_sample_and_frees_the_cache(llm):
    eng = llm.llm_engine
    free = eng.kv_blocks_free()
    eng.add_request("a", "def f():", SamplingParams(n=3, max_tokens=50, output_kind=RequestOutputKind.FINAL_ONLY))
    eng.step()
    eng.step()
    eng.abort_request("a")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    outs += eng.step()
    assert len(outs) == 1 and outs[0].request_id == "a" and outs[0].finished
    assert [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert eng.kv_blocks_free() == free and not eng.requests and not eng.parallel.parents


def test_request_ids_of_samples_cannot_collide(llm):
    eng = llm.llm_engine
    eng.add_request("0_c", "x", SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="samples' ids"):
        eng.add_request("c", "x", SamplingParams(n=2, max_tokens=1))
    assert set(eng.requests) == {"0_c"}  # nothing of the refused request stays
    eng.add_request("d", "x", SamplingParams(n=2, max_tokens=1))
    for rid in ("d", "1_d"):
        with pytest.raises(InvalidRequestError, match="already in use"):
            eng.add_request(rid, "x", SamplingParams(max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()


def test_a_bad_prompt_adds_no_sample(llm):
    eng = llm.llm_engine
    with pytest.raises(InvalidRequestError, match="prompt"):
        eng.add_request("e", [10**9], SamplingParams(n=3))
    assert not eng.requests and not eng.parallel.parents and not eng.scheduler.waiting


def test_a_sample_refused_half_way_takes_the_others_back(llm, monkeypatch):
    import adaspec.engine.llm_engine as le

    made = []

    def second_fails(request_id, *a):
        made.append(request_id)
        if len(made) == 2:
            raise ValueError("seed out of range")
        return le.Sequence.__wrapped__(request_id, *a)

    second_fails.__wrapped__ = le.Sequence
    monkeypatch.setattr(le, "Sequence", second_fails)
    eng = llm.llm_engine
    with pytest.raises(InvalidRequestError, match="seed out of range"):
        eng.add_request("h", "x", SamplingParams(n=3))
    assert made == ["0_h", "1_h"]
    assert not eng.requests and not eng.parallel.parents and not eng.scheduler.waiting and not eng._unseeded
