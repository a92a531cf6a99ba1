"""Tensor parallelism on 2 GPUs (NCCL, bfloat16, CUDA graphs captured per rank with the
all-reduces inside): the same tokens as one GPU, for the no-spec, fixed-k and adaptive arms,
greedy and seeded sampling. Skipped without 2 CUDA devices."""
import pytest
import torch

from adaspec import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = ["def add(a, b):", "import numpy as np\n", [5, 6, 7, 8, 9], "class Stack:\n    def push(self, x):"] * 4
ARMS = {
    "nospec": None,
    "fixed": {"method": "dspark", "num_speculative_tokens": 7},
    "adaptive": {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": True},
}


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _fresh_policy(spec, cost_model):
    from adaspec.spec_decode.policy import AdaptivePolicy

    spec.policy = AdaptivePolicy(cost_model, spec.num_spec_tokens, spec.cfg.adaptive_verification_ema_alpha)


@pytest.mark.parametrize("arm", list(ARMS))
def test_tp2_bf16_equals_tp1(arm, tmp_path):
    spec = ARMS[arm] and {**ARMS[arm], "cost_model_cache_dir": str(tmp_path)}
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512, speculative_config=spec)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=48, ignore_eos=True) for i in range(len(PROMPTS))]
    one = LLM("tiny", **kw)
    ref_greedy = _tokens(one.generate(PROMPTS, greedy))
    cost_model = None
    if arm == "adaptive":  # sampled tokens follow the verify lengths: both sizes decide from these tables
        cost_model = one.llm_engine.spec.cost_model
        _fresh_policy(one.llm_engine.spec, cost_model)
    ref_seeded = _tokens(one.generate(PROMPTS, seeded))
    del one
    torch.cuda.empty_cache()
    two = LLM("tiny", tensor_parallel_size=2, **kw)
    try:
        eng = two.llm_engine
        assert eng.runner.graphs is not None  # CUDA graphs with NCCL inside, on every rank
        assert _tokens(two.generate(PROMPTS, greedy)) == ref_greedy
        assert eng.runner.num_graph_steps > 0
        if cost_model is not None:
            _fresh_policy(eng.spec, cost_model)
        assert _tokens(two.generate(PROMPTS, seeded)) == ref_seeded
    finally:
        two.llm_engine.shutdown()
