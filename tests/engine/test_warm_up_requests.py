"""warm_up_requests (engine/warm_up.py): dummy requests through step() at startup, then an engine
that behaves as if they never ran: counters at zero, a fresh policy, every KV block free, and the
same outputs (greedy, seeded and unseeded) as an engine that did not warm up."""
import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.config import EngineConfig
from adaspec.engine.warm_up import warm_up_serving
from adaspec.errors import ConfigError


@pytest.fixture(scope="module")
def pair(micro_pair):
    return micro_pair


def _spec(pair, tmp_path):
    return {"method": "dspark", "model": pair[1], "num_speculative_tokens": 7, "enable_adaptive_verification": True,
            "adaptive_verification_online_calibration": True, "cost_model_cache_dir": str(tmp_path),
            # the tables alone: a measured overhead follows wall time, so two engines' budgets (and
            # sampled texts) would differ whatever the warm-up left
            "adaptive_verification_step_overhead_ms": 0}


def _run(llm):
    # the unseeded requests' seeds come from the engine's own generator (EngineConfig.seed): the
    # warm-up's requests bring seeds of their own, so it draws none of them
    prompts = [[5 + i, 9, 17 + 2 * i] for i in range(5)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seeded = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=20, ignore_eos=True)
                                    for i in range(5)])
    unseeded = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    return [[o.outputs[0].token_ids for o in outs] for outs in (greedy, seeded, unseeded)]


def test_a_warmed_up_engine_forgets_the_dummy_requests(pair, tmp_path):
    # one cost-table cache: the second engine reads the first one's tables, so both price steps
    # alike (sampled outputs depend on how many drafts the policy verifies)
    cold = LLM(pair[0], speculative_config=_spec(pair, tmp_path))
    warm = LLM(pair[0], speculative_config=_spec(pair, tmp_path), warm_up_requests=True)
    eng = warm.llm_engine
    assert cold.llm_engine.warm_up_result is None  # CPU: off unless asked for
    result = eng.warm_up_result
    assert result.requests == 23 and result.steps >= 10  # ten phases, each at least one step
    # nothing of them is left: no request, every block free, counters at zero, a policy that saw nothing
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng._in_flight is None and eng._spec_in_flight is None
    assert eng.kv_blocks_free() == eng.kv_blocks_total()
    assert eng.stats.num_steps == eng.stats.num_generated_tokens == eng.stats.num_requests_finished == 0
    assert eng.stats.num_drafts == 0 and sum(eng.stats.accepted_per_pos) == 0
    assert len(eng.stats.accepted_per_pos) == 7
    budget = eng.spec.policy.budget
    assert budget.correction.predicted.sum() == 0 and not budget.last_conf and budget.population is None
    assert _run(warm) == _run(cold)
    assert eng.stats.num_drafts > 0 and eng.stats.num_requests_finished == 15


def test_the_warm_up_runs_every_phase_shape(pair, tmp_path):
    """The steps it ran: one request alone, several together, a request joined mid-decode (a step
    with decodes and prefill rows), logprobs and top-k / top-p rows, greedy and sampled."""
    llm = LLM(pair[0], speculative_config=_spec(pair, tmp_path))
    eng = llm.llm_engine
    seen = []
    inner = eng.scheduler.schedule

    def schedule(*args, **kwargs):
        scheduled = inner(*args, **kwargs)
        seen.append([(s.num_tokens, s.seq.params.temperature, s.seq.params.logprobs, s.seq.params.top_k)
                     for s in scheduled])
        return scheduled

    eng.scheduler.schedule = schedule
    rng, own = torch.get_rng_state(), eng._seed_source.get_state()
    warm_up_serving(eng)
    assert torch.equal(torch.get_rng_state(), rng)  # it drew no seed from torch's global generator
    assert torch.equal(eng._seed_source.get_state(), own)  # nor from the engine's (EngineConfig.seed)
    assert any(len(rows) == 1 for rows in seen)
    assert any(len(rows) == 4 for rows in seen)
    # a step in which a request decodes (one token to run) beside one still to prefill
    assert any(any(n == 1 for n, *_ in rows) and any(n > 1 for n, *_ in rows) for rows in seen)
    assert any(any(lp == 1 for _, _, lp, _ in rows) for rows in seen)
    assert any(any(k == 20 for *_, k in rows) for rows in seen)
    assert any({t for _, t, _, _ in rows} == {0.0, 1.0} for rows in seen)
    assert eng.stats.num_steps == 0 and eng.spec.policy.budget.correction.predicted.sum() == 0
    # structured outputs' view of the vocabulary is built before any request asks for it
    from adaspec.sample import structured_outputs as so

    assert (eng.model_config.vocab_size, tuple(sorted(eng.stop_checker.eos_token_ids))) in so._tokenizers[eng.tokenizer]


def test_it_refuses_a_busy_engine_and_bad_config(pair, tmp_path):
    llm = LLM(pair[0])
    llm.llm_engine.add_request("live", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up_serving(llm.llm_engine)
    with pytest.raises(ConfigError, match="warm_up_requests"):
        EngineConfig(model=pair[0], warm_up_requests="yes")


def test_a_plain_engine_warms_up_too(micro_qwen3):
    llm = LLM(str(micro_qwen3), warm_up_requests=True)
    assert llm.llm_engine.warm_up_result.requests == 23
    assert llm.llm_engine.stats.num_steps == 0
