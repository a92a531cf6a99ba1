"""More ranks than KV heads (its own module: the engine tests' TP=2 engines hold this process's
group while their module runs)."""
import pytest

from adaspec import LLM, SamplingParams
from .test_tp_engine import PROMPTS, _kw, _tokens


@pytest.mark.slow
def test_four_ranks_replicate_the_kv_heads(tmp_path):
    """tiny has 2 KV heads: at 4 ranks each KV head lives on two ranks (each rank's cache holds
    the one its 1 query head reads); speculative greedy tokens still equal one rank's."""
    kw = _kw("fixed", tmp_path)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _tokens(LLM("tiny", **kw).generate(PROMPTS, p))
    four = LLM("tiny", tensor_parallel_size=4, **kw)
    try:
        assert four.llm_engine.kv_caches[0][0].shape[1] == 1  # this rank's KV heads
        assert _tokens(four.generate(PROMPTS, p)) == want
    finally:
        four.llm_engine.shutdown()
