"""Speculative decoding in the engine: greedy equivalence, statistics, config refusals."""
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.errors import ConfigError
from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir, pin_cost_tables


@pytest.fixture(scope="module")
def bigram_pair(tmp_path_factory):
    """A mostly-bigram target and a bigram drafter: drafts are often but not always accepted."""
    root = tmp_path_factory.mktemp("bigram")
    target = make_micro_model_dir(root / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    drafter = make_bigram_drafter_dir(root / "drafter", target, block_size=7)
    return str(target), str(drafter)


def _prompts(n=18, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (L,), generator=g).tolist() for L in torch.randint(1, 50, (n,), generator=g).tolist()]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(bigram_pair):
    return [o.outputs[0].token_ids for o in LLM(bigram_pair[0]).generate(_prompts(), GREEDY)]


def _spec_llm(pair, tmp_path, k, adaptive=False, **kw):
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": k,
           "enable_adaptive_verification": adaptive, "cost_model_cache_dir": str(tmp_path)}
    llm = LLM(pair[0], speculative_config=cfg, **kw)
    if adaptive:
        pin_cost_tables(llm)  # its drafts must run whatever this machine's load makes of the tables
    return llm


@pytest.mark.parametrize("k, adaptive", [(1, False), (3, False), (7, False), (7, True)])
def test_greedy_speculative_equals_plain(bigram_pair, plain_greedy, tmp_path, k, adaptive):
    # small token budget (chunked prefill mixed with verification) and a small KV cache (preemption)
    llm = _spec_llm(bigram_pair, tmp_path, k, adaptive, max_num_seqs=16, max_num_batched_tokens=40,
                    block_size=4, num_kv_blocks=70, max_model_len=128)
    outs = llm.generate(_prompts(), GREEDY)
    eng = llm.llm_engine
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    st = eng.stats
    assert st.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert st.num_accepted_tokens > 0 and st.num_accepted_tokens < st.num_verified_tokens  # accepts AND rejects
    assert eng.kv_blocks_free() == eng.kv_blocks_total() and not eng.has_unfinished_requests()
    # the statistics add up
    assert st.num_accepted_tokens <= st.num_verified_tokens <= st.num_draft_tokens
    assert st.num_generated_tokens == st.num_accepted_tokens + st.num_bonus_tokens + st.num_sampled_without_draft
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    assert all(a >= b for a, b in zip(st.accepted_per_pos, st.accepted_per_pos[1:]))
    if not adaptive:
        assert st.num_verified_tokens == st.num_draft_tokens - st.num_capped_draft_slots


def test_adaptive_verifies_fewer_drafts_at_high_load(bigram_pair, tmp_path):
    """With many requests the budget is cut below the full block; B* and lengths are recorded."""
    from adaspec.spec_decode.policy import AdaptivePolicy
    from adaspec.spec_decode.cost_model import CostModel, CostTable

    llm = _spec_llm(bigram_pair, tmp_path, 7, adaptive=True, max_num_seqs=64)
    # a machine where drafting is cheap and verification cost grows with every token (compute
    # bound), so a full batch cannot afford every slot: the measured tables are too noisy to assert on
    sizes = [1, 8, 64, 512]
    cost = CostModel(CostTable(sizes, [1.0 + s for s in sizes]), CostTable([1, 64], [0.1, 0.1]))
    llm.llm_engine.spec.policy = AdaptivePolicy(cost, 7)
    llm.generate(_prompts(64, seed=4), GREEDY)
    st = llm.llm_engine.stats
    assert sum(st.budget_hist.values()) > 0 and sum(st.verify_len_hist.values()) > 0
    # fewer verified than reserved: slots capped near max_tokens do not count as the policy's cut
    assert st.num_verified_tokens < st.num_draft_tokens - st.num_capped_draft_slots


def test_logprobs_with_speculation_match_plain(bigram_pair, tmp_path):
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = _prompts(4, seed=9)
    plain = LLM(bigram_pair[0]).generate(prompts, p)
    spec = _spec_llm(bigram_pair, tmp_path, 7, adaptive=True, max_num_seqs=8).generate(prompts, p)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)


def test_stop_applies_to_accepted_tokens(bigram_pair, tmp_path, plain_greedy):
    """A stop token inside a multi-token acceptance ends the request exactly there."""
    prompts = _prompts()
    stop_tok = plain_greedy[0][5]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok])
    plain = [o.outputs[0].token_ids for o in LLM(bigram_pair[0]).generate(prompts, p)]
    spec = [o.outputs[0].token_ids for o in _spec_llm(bigram_pair, tmp_path, 7).generate(prompts, p)]
    assert spec == plain
    assert plain[0][-1] == stop_tok and len(plain[0]) <= 6


@pytest.mark.parametrize("cfg, needle", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"num_speculative_tokens": 9}, "exceeds the drafter's block_size=7"),
    ({"method": "eagle3"}, "method 'eagle3' is not supported"),
    ({"draft_sample_method": "beam"}, "draft_sample_method"),
    ({"num_speculative_tokenz": 3}, "unknown speculative_config key"),
    ({"cost_model_cache_dir": 5, "enable_adaptive_verification": True}, "cost_model_cache_dir must be a string"),
    ({"method": 5}, "method must be a string"),
])
def test_bad_speculative_configs_are_refused(bigram_pair, cfg, needle):
    with pytest.raises(ConfigError, match=needle):
        LLM(bigram_pair[0], speculative_config={"method": "dspark", "model": bigram_pair[1], **cfg})


@pytest.mark.parametrize("value, kind", [([1, 2], "a JSON list"), ("[1, 2]", "a JSON list"), ("7", "a JSON number"),
                                         ('"abc"', "a JSON string"), (True, "a JSON true/false")])
def test_a_speculative_config_that_is_no_object_is_refused_by_name(bigram_pair, value, kind):
    """A list, number or string (JSON text too) was a TypeError traceback, or with [] no speculation."""
    with pytest.raises(ConfigError, match=f"speculative_config must be a JSON object .*got {kind}"):
        LLM(bigram_pair[0], speculative_config=value)


@pytest.mark.parametrize("empty", [{}, "{}"])
def test_an_empty_speculative_config_is_the_defaults_not_off(empty):
    """{} asks for speculation with every default (the shipped drafter), as {"method": "dspark"}
    does; it was taken for no speculative config at all."""
    llm = LLM("tiny", device="cpu", speculative_config=empty)
    assert llm.llm_engine.spec is not None and llm.llm_engine.spec.num_spec_tokens == 7


def test_drafter_for_another_target_is_refused(bigram_pair, tmp_path):
    other = make_micro_model_dir(tmp_path / "other", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ConfigError, match="not trained for this target"):
        LLM(str(other), speculative_config={"method": "dspark", "model": bigram_pair[1]})
    with pytest.raises(ConfigError, match="needs \"model\""):
        LLM(str(other), speculative_config={"method": "dspark"})


def test_cost_table_cache_key_names_the_step_it_priced(bigram_pair, tmp_path):
    """Tables measured with CUDA graphs (or by an older step) must not price another step."""
    import json

    from adaspec.spec_decode.profiler import STEP_REVISION

    _spec_llm(bigram_pair, tmp_path, 3, adaptive=True, max_num_seqs=4)
    (cached,) = list(tmp_path.glob("*.json"))
    key = json.loads(cached.read_text())["key"]
    assert key["cuda_graphs"] is False and key["step_revision"] == STEP_REVISION
    assert key["attention"] == "reference"
