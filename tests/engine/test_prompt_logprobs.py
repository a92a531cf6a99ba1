"""Prompt logprobs (engine/prompt_logprobs.py): every prompt token's logprob given the ones before
it, the prompt's top-n and the token's exact rank, from the prefill's own forward, against a dense
forward of the whole prompt; in every arm, with chunked prefill, beside requests without them,
through preemption; and the sampled tokens are the same as without them."""
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.errors import InvalidRequestError
from adaspec.models.loader import load_target
from adaspec.outputs import Logprob

PROMPTS = [list(range(5, 45)), [7, 8, 9], [300, 12, 12, 12, 900, 4, 77, 5, 5, 1000, 31, 2, 8]]
N = 3


@pytest.fixture(scope="module")
def dense():
    """Each prompt's log-softmax at every position from one dense forward."""
    model, _ = load_target("tiny")
    with torch.no_grad():
        return [torch.log_softmax(model.compute_logits(model.forward_dense(torch.tensor([p])))[0].float(), -1)
                for p in PROMPTS]


def _check(out, prompt, lp):
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    for p in range(1, len(prompt)):
        tok, row = prompt[p], lp[p - 1]
        entry = pl[p]
        assert abs(float(entry[tok]) - row[tok].item()) < 1e-4
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(N).indices.tolist()
        others = [t for t in entry if t != tok]
        assert set(top) - {tok} <= set(others) and len(entry) in (N, N + 1)
        for t in others:
            assert isinstance(entry[t], Logprob) and entry[t].rank == top.index(t) + 1
            assert abs(float(entry[t]) - row[t].item()) < 1e-4


ARMS = {
    "plain": dict(async_scheduling=False),
    "plain-chunked": dict(async_scheduling=False, max_num_batched_tokens=16),
    "async-chunked": dict(async_scheduling=True, max_num_batched_tokens=16),
    "fixed-chunked": dict(speculative_config={"method": "dspark", "num_speculative_tokens": 4},
                          max_num_batched_tokens=16),
    "adaptive": dict(speculative_config={"method": "dspark", "enable_adaptive_verification": True}),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_prompt_logprobs_match_a_dense_forward_in_every_arm(arm, dense):
    llm = LLM("tiny", **ARMS[arm])
    base = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**base))]
    # every other request asks for them: the chunks that do and the rows that do not share steps
    params = [SamplingParams(**base, prompt_logprobs=N) if i % 2 == 0 else SamplingParams(**base)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    for i, (out, prompt) in enumerate(zip(outs, PROMPTS)):
        if i % 2:
            assert out.prompt_logprobs is None
        else:
            _check(out, prompt, dense[i])


def test_rows_computed_a_few_at_a_time_give_the_same_entries(dense, monkeypatch):
    """The log-softmax runs over CHUNK_ELEMENTS logits at a time (a long prompt chunk of a large
    vocabulary): every piece lands in its own rows of the results."""
    from adaspec.engine import prompt_logprobs

    llm = LLM("tiny")
    monkeypatch.setattr(prompt_logprobs, "CHUNK_ELEMENTS", 3 * llm.llm_engine.model_config.vocab_size)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=N))
    for i, (out, prompt) in enumerate(zip(outs, PROMPTS)):
        _check(out, prompt, dense[i])


def test_a_recomputed_prompt_keeps_one_entry_per_token(dense):
    """Preemption recomputes the prompt: its positions already have entries and are not added twice."""
    llm = LLM("tiny", max_num_seqs=16, num_kv_blocks=10, max_model_len=128, max_num_batched_tokens=16)
    prompts = PROMPTS * 4
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=N))
    assert llm.llm_engine.stats.num_preemptions > 0  # the tight cache really recomputed
    for i, out in enumerate(outs):
        _check(out, prompts[i], dense[i % len(PROMPTS)])


def test_zero_top_and_the_engine_outputs():
    llm = LLM("tiny")
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert [None if d is None else list(d) for d in out.prompt_logprobs] == [None, [8], [9]]
    # the engine's own outputs (what the server reads): floats, and the ranks beside them
    eng = llm.llm_engine
    eng.add_request("r", [5, 6], SamplingParams(max_tokens=1, prompt_logprobs=1))
    final = [o for o in eng.step() if o.finished]
    assert final and type(final[0].prompt_logprobs[1][6]) is float and final[0].prompt_logprob_ranks[0] is None
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.parametrize("arm", ["plain", "async", "fixed"])
def test_a_one_token_chunk_mid_prompt_records_its_row(arm, dense):
    """The token budget can leave a prompt a 1-token chunk that does not end it: that chunk asks the
    runner for one row, which predicts a prompt token (not a sampling row). Two 7- and 8-token
    prompts fill 15 of a 16-token budget beside it; the steps' sampled rows stay the others'."""
    kw = {"plain": dict(async_scheduling=False), "async": dict(async_scheduling=True),
          "fixed": dict(speculative_config={"method": "dspark", "num_speculative_tokens": 4})}[arm]
    llm = LLM("tiny", max_num_batched_tokens=16, **kw)
    others = [list(range(100, 107)), list(range(120, 128))]
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=5, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(others, sampled)]
    outs = llm.generate(others + [PROMPTS[0]], [sampled, sampled, SamplingParams(temperature=0, max_tokens=3,
                                                                                  prompt_logprobs=N)])
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    _check(outs[2], PROMPTS[0], dense[0])
