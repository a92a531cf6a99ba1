"""Losslessness of the whole speculative engine, statistically.

A micro target with an 8-token vocabulary and a deliberately poor random drafter. The
empirical joint law of the first 3 generated tokens over 20,000 samples (global seed fixed)
must match the target's exact law, enumerated from its dense forward, under a chi-square test
(p > 0.001). The same harness must reject a deliberately broken sampler (p < 1e-6), which
shows that it can fail.
"""
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.sample.probs import processed_probs
from adaspec.models.loader import load_target
from adaspec.spec_decode.cost_model import CostModel, CostTable
from adaspec.sample.rejection import RejectionOutput
from adaspec.sample.logits_rules import LogitsRule
from adaspec.testing import pin_cost_tables, use_eager_spec_graphs
from tests.engine.test_logits_rules import reference_row
from tests.spec_decode.lossless_harness import enumerate_joint, lossless_pvalue
from tests.spec_decode.micro import broken_sampler

N = 20_000
PROMPT = [1, 2, 3]
L = 3


def exact_law(target_dir, params: SamplingParams):
    """The target's law of L tokens; a request's logits rules by their brute-force reference."""
    model, _ = load_target(target_dir)
    ruled = LogitsRule.of(params, set(), 1 << 30) is not None  # (the vocabulary: only the ids' check reads it)
    # the end-of-sequence ids the engine knows (min_tokens holds them back even with ignore_eos)
    eos = LLM(target_dir).llm_engine.stop_checker.eos_token_ids if ruled else set()

    def next_probs(ctx):
        with torch.no_grad():
            logits = model.compute_logits(model.forward_dense(torch.tensor([list(ctx)])))[:, -1]
        if ruled:
            logits = torch.tensor([reference_row(logits[0].tolist(), params, PROMPT, list(ctx[len(PROMPT):]), eos)])
        return processed_probs(logits, torch.tensor([params.temperature]), torch.tensor([params.top_p]),
                               torch.tensor([params.top_k]))[0].tolist()

    return enumerate_joint(next_probs, L, prefix=tuple(PROMPT))


def sample_fn(pair, params, tmp_path, graphed: bool = False, **spec):
    """graphed: decode steps through the speculative step's graphed path, captured eagerly (CPU),
    with the graphs' post-replay redo of filtered rows (spec_decode/graphed_extras.py)."""
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3,
           "cost_model_cache_dir": str(tmp_path), **spec}
    llm = LLM(pair[0], speculative_config=cfg, max_num_seqs=2048, max_num_batched_tokens=16384)
    if graphed:
        use_eager_spec_graphs(llm, [1, 16, 256, 2048])
    if spec.get("enable_adaptive_verification"):
        # fixed tables: the profiled ones are timed on the machine at hand, and on a loaded one they
        # made the policy skip so many drafts that the harness saw too few (CI: 4,096 verified of
        # 20,000 requests). These rise gently with the tokens, so the budget still drops the slots
        # of low survival (a few percent) and varies from step to step.
        pin_cost_tables(llm)

    def run(n):
        torch.manual_seed(1234)
        outs = llm.generate([PROMPT] * n, params)
        st = llm.llm_engine.stats
        # speculation really ran (the adaptive arm may skip drafting in some steps, losslessly)
        assert st.num_verified_tokens > n // 4 and st.num_accepted_tokens > 0
        assert (st.num_graphed_steps > 0) == graphed
        return [o.outputs[0].token_ids[:L] for o in outs]

    run.llm = llm
    return run


# max_tokens=5: after the prefill's token, the first speculative step verifies 3 drafts
T1 = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
T07 = SamplingParams(temperature=0.7, top_p=0.8, max_tokens=5, ignore_eos=True)
# logits rules (sample/logits_rules.py): position j of a verification is judged with drafts 0..j-1 in
# its history; min_tokens holds back the stop token 7 for two tokens
RULED = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.5,
                       repetition_penalty=1.4, logit_bias={2: 1.0}, min_tokens=2, stop_token_ids=[7])


@pytest.mark.parametrize("params, spec", [
    (T1, {}),
    (T07, {}),
    (T1, {"enable_adaptive_verification": True}),
    (T1, {"draft_sample_method": "greedy"}),  # argmax drafts for sampled requests: q is one-hot
    # the graphed path: top-p rows judged after the replay against drafts drawn without the filter
    (T07, {"graphed": True}),
    (T07, {"graphed": True, "enable_adaptive_verification": True}),
    (RULED, {}),
    # the graphed path: the ruled rows' positions judged after the replay with their drafts' history
    (RULED, {"graphed": True, "enable_adaptive_verification": True}),
], ids=["fixed-T1", "fixed-T0.7-top_p0.8", "adaptive-T1", "greedy-drafts-T1", "graphed-fixed-T0.7-top_p0.8",
        "graphed-adaptive-T0.7-top_p0.8", "fixed-T1-penalties-bias-min_tokens",
        "graphed-adaptive-T1-penalties-bias-min_tokens"])
def test_speculative_engine_is_lossless(lossless_micro_pair, tmp_path, params, spec):
    p = lossless_pvalue(sample_fn(lossless_micro_pair, params, tmp_path, **spec), exact_law(lossless_micro_pair[0], params), n=N)
    assert p > 1e-3


def test_harness_catches_a_broken_sampler(lossless_micro_pair, tmp_path, monkeypatch):
    broken = broken_sampler("residual_from_p")
    monkeypatch.setattr("adaspec.spec_decode.step.rejection_sample",
                        lambda *a, **kw: RejectionOutput(*broken(*a, **kw)))
    p = lossless_pvalue(sample_fn(lossless_micro_pair, T1, tmp_path), exact_law(lossless_micro_pair[0], T1), n=N)
    assert p < 1e-6


def test_narrow_drafts_of_the_eager_step_are_lossless(lossless_micro_pair, tmp_path):
    """adaptive_draft_width "budget" in the eager step (CPU, or --enforce-eager): the
    step drafts 1, 2 or 3 of the k = 3 slots in turn (any width chosen without the current drafts
    keeps the law; here a counter), allocates the budget by the drafted slots' confidences and
    verifies them; the joint law of three tokens must stay the target's."""
    run = sample_fn(lossless_micro_pair, T1, tmp_path, enable_adaptive_verification=True, adaptive_draft_width="budget")
    spec = run.llm.llm_engine.spec
    assert spec.draft_widths == [1, 2, 3] and sorted(spec.cost_model.draft_narrow) == [1, 2]
    # fixed tables (the profiled ones are timed on a loaded machine): verifying costs the same at
    # any size, so every drafted slot is verified and the harness sees as many as a fixed k would
    flat = CostTable([1, 1 << 15], [1.0, 1.0])
    spec.cost_model = CostModel(flat, CostTable([1], [0.1]), {w: CostTable([1], [0.05]) for w in (1, 2)})
    spec.policy = spec._make_policy()
    turns, drafted = iter(range(10**9)), []
    spec.policy.draft_width = lambda ids, budget, limits, widths: widths[next(turns) % len(widths)]

    def draft_block(*a, inner=spec.drafter.draft_block, **kw):
        prop = inner(*a, **kw)
        drafted.append(prop.tokens.shape[1])
        return prop

    spec.drafter.draft_block = draft_block
    p = lossless_pvalue(run, exact_law(lossless_micro_pair[0], T1), n=N)
    assert {1, 2, 3} <= set(drafted)
    st = run.llm.llm_engine.stats
    assert st.num_draft_tokens < 3 * st.num_drafts  # the slots drafted are counted, not k per request
    assert p > 1e-3
