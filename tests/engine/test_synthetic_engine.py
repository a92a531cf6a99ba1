"""The engine with `"method": "synthetic"` on the embedded tiny target (no trained drafter used):
it runs, its counters follow the curve and carry the label; the no-spec arm is untouched."""
import math

import pytest

from adaspec import LLM, SamplingParams
from adaspec.errors import ConfigError
from adaspec.spec_decode.synthetic import LABEL, SyntheticDrafter

CURVE = [0.5, 0.9, 0.3, 0.8, 0.6]
PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "for i in range(10):", "# sort a list",
           "x = [1, 2, 3]", "while True:", "print('hi')"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fixed_synthetic_run_follows_the_curve_and_is_labelled(temperature):
    spec = {"method": "synthetic", "synthetic_acceptance": CURVE, "num_speculative_tokens": 5,
            "draft_sample_method": "greedy" if temperature == 0 else "probabilistic"}
    llm = LLM("tiny", speculative_config=spec)
    eng = llm.llm_engine
    assert isinstance(eng.spec.drafter, SyntheticDrafter)
    assert eng.spec.dcfg.num_layers == 1 and eng.spec.dcfg.block_size == 5  # built from the target's config
    outs = llm.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=48, ignore_eos=True, seed=7))
    assert [len(o.outputs[0].token_ids) for o in outs] == [48] * len(PROMPTS)
    st = eng.stats
    assert st.synthetic_acceptance == LABEL and st.as_dict()["synthetic_acceptance"] == LABEL
    # position 0 is verified in every draft of the fixed policy: binomial with p = CURVE[0]
    n0 = st.verified_per_pos[0]
    assert n0 > 100
    assert abs(st.accepted_per_pos[0] / n0 - CURVE[0]) < 4 * math.sqrt(CURVE[0] * (1 - CURVE[0]) / n0)
    # the policy's inputs: confidences = CURVE + noise (std 0.05), so the predicted survival of slot j,
    # summed over verified slots, averages prod(CURVE[:j+1]) (the fixed policy verifies every slot)
    for j in (0, 1):
        assert abs(st.predicted_accept_per_pos[j] / st.verified_per_pos[j] - math.prod(CURVE[:j + 1])) < 0.02
    # the emitted tokens are counted as the target counts them: accepted drafts + one token per draft
    assert st.num_generated_tokens == 48 * len(PROMPTS)


def test_adaptive_synthetic_run(tmp_path):
    spec = {"method": "synthetic", "synthetic_acceptance": CURVE, "num_speculative_tokens": 5,
            "synthetic_confidence_noise": 0.02, "enable_adaptive_verification": True,
            "draft_sample_method": "greedy", "cost_model_cache_dir": str(tmp_path), "profile_repeats": 1,
            "profile_context_len": 32}
    llm = LLM("tiny", speculative_config=spec, max_num_seqs=4)
    outs = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    st = llm.llm_engine.stats
    assert st.synthetic_acceptance == LABEL  # (how much it drafts depends on this machine's step costs)


def test_model_gives_the_stand_ins_shape():
    llm = LLM("tiny", speculative_config={"method": "synthetic", "model": "tiny-dspark",
                                          "synthetic_acceptance": [0.7] * 7})
    eng = llm.llm_engine
    assert isinstance(eng.spec.drafter, SyntheticDrafter) and eng.spec.dcfg.num_layers == 2  # tiny-dspark's
    assert eng.spec.num_spec_tokens == 7


def test_k_below_the_stand_ins_block_needs_a_curve_of_k_values_only():
    llm = LLM("tiny", speculative_config={"method": "synthetic", "model": "tiny-dspark", "num_speculative_tokens": 3,
                                          "synthetic_acceptance": [0.6, 0.5, 0.7]})
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 16 and llm.llm_engine.stats.num_drafts > 0
    assert llm.llm_engine.spec.dcfg.block_size == 7 and llm.llm_engine.spec.num_spec_tokens == 3


def test_no_spec_and_dspark_arms_carry_no_label():
    assert LLM("tiny").llm_engine.stats.synthetic_acceptance is None
    llm = LLM("tiny", speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert llm.llm_engine.stats.synthetic_acceptance is None
    assert not isinstance(llm.llm_engine.spec.drafter, SyntheticDrafter)


@pytest.mark.parametrize("spec, needle", [
    ({"synthetic_acceptance": [0.5] * 3, "num_speculative_tokens": 4}, "synthetic_acceptance has 3 values"),
    ({"synthetic_acceptance": [0.5] * 5, "model": "tiny-dspark"}, "synthetic_acceptance has 5 values but the drafter drafts k=7"),
    ({"synthetic_acceptance": [0.5, 2]}, "synthetic_acceptance must hold numbers in"),
    ({"synthetic_acceptance": [0.5] * 3, "synthetic_drafter": {"mask_token_id": 10 ** 6}}, "synthetic_drafter.mask_token_id"),
])
def test_engine_refuses_bad_synthetic_configs(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        LLM("tiny", speculative_config={"method": "synthetic", **spec})


def test_seeded_synthetic_output_independent_of_batch():
    """Draws are keyed by (seed, position, anchor): a seeded request's text (drafts kept, target tokens
    after them) is the same alone and among other requests."""
    spec = {"method": "synthetic", "synthetic_acceptance": CURVE, "num_speculative_tokens": 5}
    llm = LLM("tiny", speculative_config=spec, max_num_seqs=8)

    def seeded(i):
        return SamplingParams(temperature=1.0, max_tokens=32, seed=500 + i, ignore_eos=True)

    alone = [llm.generate([p], seeded(i))[0].outputs[0].token_ids for i, p in enumerate(PROMPTS[:3])]
    others = [SamplingParams(temperature=0.8, max_tokens=10 + 5 * i, ignore_eos=True) for i in range(3)]
    outs = llm.generate(PROMPTS[5:8] + PROMPTS[:3], others + [seeded(i) for i in range(3)])
    assert [o.outputs[0].token_ids for o in outs[3:]] == alone
