"""Continuous batching, chunked prefill, preemption, sampling: outputs must not depend on batching."""
import pytest
import torch

from adaspec import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

N_NEW = 12


def _prompts(n=18, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (n,), generator=g).tolist()
    return [torch.randint(1, 300, (L,), generator=g).tolist() for L in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def solo_outputs(micro_qwen3):
    llm = LLM(str(micro_qwen3), max_num_seqs=1)
    return [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in _prompts()]


def test_batched_chunked_equals_solo_and_transformers(micro_qwen3, solo_outputs):
    prompts = _prompts()
    # a small token budget forces chunked prefill mixed with decodes
    llm = LLM(str(micro_qwen3), max_num_seqs=16, max_num_batched_tokens=24, block_size=4)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == solo_outputs
    hf = transformers.AutoModelForCausalLM.from_pretrained(micro_qwen3, dtype=torch.float32).eval()
    for p, ours in zip(prompts, solo_outputs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert ref[0, len(p):].tolist() == ours


def test_preemption_changes_nothing_and_frees_blocks(micro_qwen3, solo_outputs):
    prompts = _prompts()
    # 40 blocks of 4 tokens: far less than 18 requests need, so requests get preempted
    llm = LLM(str(micro_qwen3), max_num_seqs=16, max_num_batched_tokens=64, block_size=4, num_kv_blocks=40,
              max_model_len=128)
    outs = llm.generate(prompts, GREEDY)
    eng = llm.llm_engine
    assert eng.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == solo_outputs
    assert eng.kv_blocks_free() == eng.kv_blocks_total()
    assert not eng.has_unfinished_requests()
    # prompt tokens run through the target: every prompt once, plus what preemption recomputed
    assert eng.stats.num_prompt_tokens >= sum(len(p) for p in prompts)


def test_seeded_sampling_is_reproducible(micro_qwen3):
    llm = LLM(str(micro_qwen3), max_num_seqs=8)
    prompts = _prompts(6, seed=3)

    def run(seed, batch_with_others):
        p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=16, ignore_eos=True)
        others = [SamplingParams(temperature=0.8, max_tokens=5)] * 5 if batch_with_others else []
        outs = llm.generate([prompts[0]] + prompts[1:1 + len(others)], [p] + others)
        return outs[0].outputs[0].token_ids

    a, b = run(7, False), run(7, True)
    assert a == b
    assert run(8, False) != a


def test_stop_conditions(micro_qwen3):
    llm = LLM(str(micro_qwen3))
    prompt = _prompts(1, seed=5)[0]
    full = llm.generate([prompt], GREEDY)[0].outputs[0]
    # stop token id: ends right after the first occurrence of the 4th generated token
    tok = full.token_ids[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True,
                                                stop_token_ids=[tok]))[0].outputs[0]
    first = full.token_ids.index(tok)
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    # max_tokens
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full.token_ids[:3] and out.finish_reason == "length"


def test_stop_string_cuts_text(micro_qwen3):
    llm = LLM(str(micro_qwen3))
    prompt = "def fib(n):"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    text = full.text
    # any clean 2-character piece past the start (a random model emits odd bytes)
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]


def test_abort_frees_blocks(micro_qwen3):
    llm = LLM(str(micro_qwen3))
    eng = llm.llm_engine
    for i in range(4):
        eng.add_request(f"r{i}", _prompts(4)[i], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort_request("r1")
    eng.abort_request("r3")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["r1"].finished and outs["r1"].outputs[0].finish_reason == "abort"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv_blocks_free() == eng.kv_blocks_total()


def test_logprobs_are_log_softmax_of_model(micro_qwen3):
    llm = LLM(str(micro_qwen3))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 2
    first = c.logprobs[0]
    assert c.token_ids[0] in first and len(first) == 3  # greedy token is also the top-1
    model = llm.llm_engine.model
    with torch.no_grad():
        lp = torch.log_softmax(model.compute_logits(model.forward_dense(torch.tensor([[5, 6, 7]])))[0, -1], -1)
    for tid, v in first.items():
        assert abs(lp[tid].item() - v) < 1e-4
