"""Async scheduling (engine/async_step.py): step t is launched before step t-1's tokens are read
back, its inputs taken on the device from step t-1's output. Whatever the batching, stops,
preemption or aborts, the outputs must be a synchronous engine's, token for token."""
import math

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.engine.async_step import PENDING
from adaspec.sampling_params import RequestOutputKind


def _prompts(n, seed=0, vocab=300):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 50, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lengths]


def _params(n):
    """Greedy and seeded rows, logprobs on some, stop tokens common enough to end some requests
    early (so a request stops while its next step is already launched), output kinds mixed."""
    out = []
    for i in range(n):
        out.append(SamplingParams(
            max_tokens=6 + (5 * i) % 17, temperature=0.0 if i % 2 else 1.0, seed=100 + i,
            logprobs=2 if i % 3 == 0 else None, stop_token_ids=[7, 11, 19, 23, 42] if i % 4 else [],
            ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY if i % 5 == 4 else RequestOutputKind.CUMULATIVE))
    return out


def _run(model, async_scheduling, prompts, params, **kw):
    llm = LLM(str(model), async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompts, params)
    return llm.llm_engine, [o.outputs[0] for o in outs]


def _same(want, got):
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert PENDING not in g.token_ids
        assert (g.text, g.finish_reason, g.stop_reason) == (w.text, w.finish_reason, w.stop_reason)
        assert (g.logprobs is None) == (w.logprobs is None)
        for lw, lg in zip(w.logprobs or [], g.logprobs or [], strict=True):
            # rows batched differently (a discarded row is still computed) move float32 by ~1e-7
            assert lw.keys() == lg.keys()
            assert all(math.isclose(lw[t], lg[t], rel_tol=1e-5, abs_tol=1e-5) for t in lw)


@pytest.mark.parametrize("kw", [
    dict(max_num_seqs=6, max_num_batched_tokens=32, block_size=4),  # waves of admissions, chunked prefill
    dict(max_num_seqs=16, max_num_batched_tokens=64, block_size=4, num_kv_blocks=30, max_model_len=96),  # preemption
], ids=["chunked", "preempting"])
def test_async_outputs_equal_sync(micro_qwen3, kw):
    prompts, params = _prompts(16), _params(16)
    sync, want = _run(micro_qwen3, False, prompts, params, **kw)
    eng, got = _run(micro_qwen3, True, prompts, params, **kw)
    _same(want, got)
    assert eng.async_scheduling and not sync.async_scheduling
    assert eng.stats.num_discarded_rows > 0  # some requests stopped with their next step in flight
    assert eng.num_result_waits == eng.stats.num_steps  # one read back per step, none in between
    assert eng.kv_blocks_free() == eng.kv_blocks_total() and not eng.has_unfinished_requests()
    if "num_kv_blocks" in kw:
        assert eng.stats.num_preemptions > 0


def test_async_stop_strings_and_max_model_len(micro_qwen3):
    prompts = _prompts(8, seed=5)
    # text stops (decoded text, held-back partial matches) and requests ended by max_model_len
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=i, stop=["a", "e "] if i % 2 else None,
                             ignore_eos=True) for i in range(8)]
    _, want = _run(micro_qwen3, False, prompts, params, max_num_seqs=8, max_model_len=60)
    _, got = _run(micro_qwen3, True, prompts, params, max_num_seqs=8, max_model_len=60)
    _same(want, got)
    assert {g.finish_reason for g in got} == {"stop", "length"}


def test_abort_with_a_step_in_flight(micro_qwen3):
    llm = LLM(str(micro_qwen3), async_scheduling=True, max_num_seqs=8)
    eng = llm.llm_engine
    prompts = _prompts(4, seed=2)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng._in_flight is not None and PENDING in eng.requests["1"].token_ids
    eng.abort_request("1")
    finals = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    eng.step()  # resolves the last step launched, whose rows all belong to finished requests
    assert eng._in_flight is None
    assert finals["1"].outputs[0].finish_reason == "abort"
    assert PENDING not in finals["1"].outputs[0].token_ids
    ref = LLM(str(micro_qwen3), async_scheduling=False).generate(
        [prompts[i] for i in (0, 2, 3)], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert [finals[r].outputs[0].token_ids for r in "023"] == [o.outputs[0].token_ids for o in ref]
    assert eng.kv_blocks_free() == eng.kv_blocks_total()


def test_requests_added_between_steps(micro_qwen3):
    """Arrivals while others decode: prefill chunks mixed with decodes whose input is in flight."""
    prompts = _prompts(10, seed=9)
    params = [SamplingParams(max_tokens=5 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(10)]

    def run(async_scheduling):
        eng = LLM(str(micro_qwen3), async_scheduling=async_scheduling, max_num_seqs=4,
                  max_num_batched_tokens=16, block_size=4).llm_engine
        finals, step = {}, 0
        while len(finals) < len(prompts):
            if step < len(prompts):
                eng.add_request(str(step), prompts[step], params[step])
            step += 1
            finals.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        return finals

    assert run(True) == run(False)


def test_async_scheduling_config(micro_qwen3, tmp_path):
    from adaspec.testing import make_micro_drafter_dir

    assert LLM(str(micro_qwen3)).llm_engine.async_scheduling is False  # auto: CUDA only
    drafter = make_micro_drafter_dir(tmp_path / "d", micro_qwen3, block_size=4)
    spec = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 3}
    # fixed k pipelines its steps through the speculative step's graphs (tests/spec_decode/test_pipelined.py);
    # asked for without them it changes nothing; auto: CUDA only
    assert LLM(str(micro_qwen3), async_scheduling=True, speculative_config=spec).llm_engine.async_scheduling is True
    assert LLM(str(micro_qwen3), speculative_config=spec).llm_engine.async_scheduling is False


def test_requests_ending_by_length_are_not_scheduled_again(micro_qwen3):
    """max_tokens and max_model_len are known before the last token is read back: such a request
    gets no further row (only stops the host cannot foresee, EOS, stop tokens and strings, cost one)."""
    prompts = [p[:20] for p in _prompts(6, seed=4)]
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0, ignore_eos=True) for i in range(6)]
    eng, got = _run(micro_qwen3, True, prompts, params, max_num_seqs=6, max_model_len=40)
    _, want = _run(micro_qwen3, False, prompts, params, max_num_seqs=6, max_model_len=40)
    _same(want, got)
    assert {g.finish_reason for g in got} == {"length"}
    assert eng.stats.num_discarded_rows == 0
