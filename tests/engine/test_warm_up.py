"""ModelRunner.warm_up: the start-up forwards that make Triton and torch.compile build their
variants before serving (run by the engine on CUDA) touch only the scratch block of the cache."""
import torch

from adaspec import LLM, SamplingParams


def test_warm_up_writes_only_the_scratch_block(micro_qwen3):
    llm = LLM(str(micro_qwen3), max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
    eng = llm.llm_engine
    for c in eng.kv_caches:
        for t in c:
            t.normal_()
    before = [[t.clone() for t in c] for c in eng.kv_caches]
    runs = eng.runner.warm_up(eng.scratch_block, 8, 64)
    assert runs == 11  # chunks of 2..64 tokens, each alone and as a full batch (64 alone once)
    lo, hi = eng.scratch_block * 4, (eng.scratch_block + 1) * 4
    for c0, c1 in zip(before, eng.kv_caches):
        for t0, t1 in zip(c0, c1):
            assert torch.equal(t0[:lo], t1[:lo]) and torch.equal(t0[hi:], t1[hi:])
            assert not torch.equal(t0[lo:hi], t1[lo:hi])
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
