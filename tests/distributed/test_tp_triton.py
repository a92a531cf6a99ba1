"""The GPU's attention path under tensor parallelism, on CPU: the Triton paged kernel (in its
interpreter) over each rank's local heads (2 query heads, 1 KV head per rank), for the target
and the drafter's bidirectional block. Greedy speculative tokens equal one rank's (on the reference
backend)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # inherited by the spawned workers
pytest.importorskip("triton")

from adaspec import LLM, SamplingParams  # noqa: E402
from adaspec.testing import make_micro_drafter_dir, make_micro_model_dir  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs CUDA or Triton's interpreter")


def test_triton_attention_tp2_equals_tp1(tmp_path):
    target = make_micro_model_dir(tmp_path / "t", vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, init_std=0.3,
                                  seed=3, max_position_embeddings=128)
    drafter = make_micro_drafter_dir(tmp_path / "d", target, block_size=4, init_std=0.3, markov_rank=8, seed=4)
    kw = dict(speculative_config={"method": "dspark", "model": str(drafter), "num_speculative_tokens": 3},
              attention_backend="triton", max_num_seqs=4, device="cpu", skip_tokenizer_init=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in (5, 9, 14)]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # one rank on the reference backend (pure torch; the kernel is checked against it in
    # tests/models/test_paged_attention_triton.py): a fraction of a second, not ~7 s of interpreter
    one = LLM(str(target), **dict(kw, attention_backend="reference"))
    want = [o.outputs[0].token_ids for o in one.generate(prompts, p)]
    two = LLM(str(target), tensor_parallel_size=2, **kw)
    try:
        assert two.llm_engine.attention_backend == "triton"
        assert [o.outputs[0].token_ids for o in two.generate(prompts, p)] == want
        a, b = one.llm_engine.stats, two.llm_engine.stats
        assert b.num_drafts > 0  # the drafter's block attention ran through the kernel too
        assert (b.num_drafts, b.num_accepted_tokens) == (a.num_drafts, a.num_accepted_tokens)  # same drafts
    finally:
        two.llm_engine.shutdown()
