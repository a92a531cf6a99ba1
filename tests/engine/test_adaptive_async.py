"""Adaptive speculation under async scheduling: steps the policy expects drafting not to pay for
run as the plain engine's async steps (no draft slots, the drafter's context written on the
device), the others as synchronous speculative steps. Whatever the sequence of the two kinds,
greedy outputs are the target's, and the drafter sees the same context as when every step is
synchronous."""
import dataclasses
import random

import pytest
import torch

from adaspec import LLM, SamplingParams
from adaspec.engine.async_step import PENDING
from adaspec.errors import ConfigError
from adaspec.sampling_params import RequestOutputKind
from adaspec.testing import (assert_same_proposals, make_bigram_drafter_dir, make_micro_drafter_dir,
                             make_micro_model_dir, record_proposals)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive_async")
    target = make_micro_model_dir(root / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    return str(target), str(make_bigram_drafter_dir(root / "drafter", target, block_size=7))


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (L,), generator=g).tolist() for L in torch.randint(1, 50, (n,), generator=g).tolist()]


def _params(n):
    """Greedy rows: stop tokens that end some requests while a plain step is in flight, logprobs
    on some (their rows take the eager part of a speculative step), both output kinds."""
    return [SamplingParams(temperature=0, max_tokens=8 + (7 * i) % 23, ignore_eos=True,
                           stop_token_ids=[7, 11, 19] if i % 3 else [], logprobs=2 if i % 4 == 1 else None,
                           output_kind=RequestOutputKind.FINAL_ONLY if i % 5 == 4 else RequestOutputKind.CUMULATIVE)
            for i in range(n)]


def _llm(pair, tmp_path, async_scheduling, k=7, **kw):
    # the tables alone: a measured overhead follows wall time, and the sync and async engines
    # compared here must verify alike
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": k, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path), "adaptive_verification_step_overhead_ms": 0}
    return LLM(pair[0], speculative_config=cfg, async_scheduling=async_scheduling, **kw)


def _script(llm, drafts_at, async_mode: bool):
    """Make step n (1-based, as stats.num_steps counts them) draft iff drafts_at(n), where any
    of its rows could draft."""
    eng = llm.llm_engine
    policy = eng.spec.policy
    if async_mode:  # asked before the step is counted (a drafting step), or after it (a plain one)
        policy.should_draft = lambda *a, **kw: drafts_at(eng.stats.num_steps + 1)
        policy.plain_step_done = lambda *a: drafts_at(eng.stats.num_steps + 1)
    else:  # the synchronous engine decides inside the step (counted before it runs)
        policy.should_draft = lambda *a, **kw: drafts_at(eng.stats.num_steps)


def _same(want, got):
    for w, g in zip(want, got, strict=True):
        assert PENDING not in g.token_ids
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                          w.stop_reason)
        assert (g.logprobs is None) == (w.logprobs is None)


@pytest.mark.parametrize("kw", [
    dict(max_num_seqs=8, max_num_batched_tokens=40, block_size=4),  # chunked prefill, waves of admissions
    dict(max_num_seqs=16, max_num_batched_tokens=64, block_size=4, num_kv_blocks=70, max_model_len=128),  # preemption
], ids=["chunked", "preempting"])
@pytest.mark.parametrize("pattern", ["random", "plain_runs"])
def test_greedy_outputs_are_the_targets_whatever_the_mix_of_steps(pair, tmp_path, kw, pattern):
    prompts, params = _prompts(20), _params(20)
    want = [o.outputs[0] for o in LLM(pair[0], **kw).generate(prompts, params)]
    llm = _llm(pair, tmp_path, True, **kw)
    rng = random.Random(1)
    # random: switches nearly every step; plain_runs: 6 plain steps then 2 drafting ones
    drafts_at = (lambda n: rng.random() < 0.5) if pattern == "random" else (lambda n: n % 8 >= 6)
    _script(llm, drafts_at, async_mode=True)
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    _same(want, got)
    eng, st = llm.llm_engine, llm.llm_engine.stats
    assert eng.async_scheduling and eng.num_result_waits > 0  # plain steps ran asynchronously
    assert st.num_steps_draft_skipped > 0 and st.num_draft_tokens > 0  # both kinds of step ran
    assert eng.kv_blocks_free() == eng.kv_blocks_total() and not eng.has_unfinished_requests()
    # a plain row of a request that stopped in the step before is computed and thrown away: counted
    # as discarded, not as sampled
    assert st.num_generated_tokens == st.num_accepted_tokens + st.num_bonus_tokens + st.num_sampled_without_draft
    if "num_kv_blocks" in kw:
        assert st.num_preemptions > 0, "the KV budget was meant to force preemption"


def test_plain_async_steps_write_the_drafters_context(pair, tmp_path):
    """The same steps draft in a synchronous engine (skipped steps through the speculative step's
    own path) and in the async one (skipped steps as plain async steps), with a drafter that
    attends to its context: every proposal (drafts and confidences) is the same only if the plain
    async steps wrote the drafter's context as the others do."""
    drafter = make_micro_drafter_dir(tmp_path / "ctx_drafter", pair[0], block_size=4, seed=2, init_std=0.3)
    prompts = _prompts(6, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    drafts_at = lambda n: n % 5 == 0  # noqa: E731  four plain steps, then one that drafts
    runs = []
    # the third run builds the context's slots on the host from the block tables instead of taking
    # the forward's own (an independent check of both)
    for async_mode, forward_slots in ((False, True), (True, True), (True, False)):
        llm = _llm((pair[0], str(drafter)), tmp_path, async_mode, k=4, max_num_seqs=8, max_num_batched_tokens=512)
        _script(llm, drafts_at, async_mode)
        if not forward_slots:
            runner, execute = llm.llm_engine.runner, llm.llm_engine.runner.execute
            runner.execute = lambda *a, _execute=execute, **kw: dataclasses.replace(
                _execute(*a, **kw), positions=None, slot_mapping=None)
        proposals = record_proposals(llm.llm_engine.spec.drafter)
        llm.generate(prompts, params)
        runs.append((llm.llm_engine.stats.num_steps, proposals))
    assert len(runs[0][1]) >= 5
    for other in runs[1:]:
        assert runs[0][0] == other[0]
        assert_same_proposals(runs[0][1], other[1])


def test_abort_while_a_plain_step_is_in_flight(pair, tmp_path):
    llm = _llm(pair, tmp_path, True, max_num_seqs=8)
    _script(llm, lambda n: False, async_mode=True)
    eng = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(_prompts(4, seed=2)):
        eng.add_request(str(i), prompt, p)
    for _ in range(4):
        eng.step()
    assert eng._in_flight is not None
    eng.abort_request("1")
    finished = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["1"].outputs[0].finish_reason == "abort"
    assert PENDING not in finished["1"].outputs[0].token_ids
    assert all(len(finished[r].outputs[0].token_ids) == 30 for r in "023")
    assert eng.kv_blocks_free() == eng.kv_blocks_total()


def test_async_scheduling_with_fixed_k_without_graphs_changes_nothing(pair, tmp_path):
    """Fixed k pipelines its steps only through the speculative step's graphs
    (tests/spec_decode/test_pipelined.py); without them async scheduling may be asked for and
    every step drafts from tokens on the host, as a synchronous engine's. Auto: off on CPU."""
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3, "cost_model_cache_dir": str(tmp_path)}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(pair[0], speculative_config=cfg, async_scheduling=True)
    assert llm.llm_engine.async_scheduling and not llm.llm_engine._pipelines_spec()
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(6), params)]
    sync = LLM(pair[0], speculative_config=cfg)
    assert not sync.llm_engine.async_scheduling  # auto: off (and CPU)
    assert got == [o.outputs[0].token_ids for o in sync.generate(_prompts(6), params)]
    assert llm.llm_engine.stats.num_pipelined_steps == 0 and llm.llm_engine.num_result_waits == 0


def test_step_costs_setting(pair, tmp_path):
    from adaspec.spec_decode.step_costs import MeasuredStepCosts

    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3, "enable_adaptive_verification": True,
           "cost_model_cache_dir": str(tmp_path)}
    default = LLM(pair[0], speculative_config=cfg).llm_engine.spec.policy
    assert default.step_costs is None  # the tables alone, unless asked
    measured = LLM(pair[0], speculative_config={**cfg, "adaptive_verification_step_costs": "measured"})
    assert isinstance(measured.llm_engine.spec.policy.step_costs, MeasuredStepCosts)
    with pytest.raises(ConfigError, match="adaptive_verification_step_costs"):
        LLM(pair[0], speculative_config={**cfg, "adaptive_verification_step_costs": "wall"})
    # what a request no step drafted for counts as: 1.0 with the tables, the population's with measured costs
    assert default.budget.unknown == "one" and measured.llm_engine.spec.policy.budget.unknown == "population"
    population = LLM(pair[0], speculative_config={**cfg, "adaptive_verification_unobserved_confidence": "population"})
    assert population.llm_engine.spec.policy.budget.unknown == "population"
    with pytest.raises(ConfigError, match="adaptive_verification_unobserved_confidence"):
        LLM(pair[0], speculative_config={**cfg, "adaptive_verification_unobserved_confidence": "zero"})


def test_context_warm_up_writes_only_the_scratch_block(pair, tmp_path):
    """The start-up write that compiles the context kernels (run on CUDA) touches no real block."""
    llm = _llm(pair, tmp_path, False, max_num_seqs=4)
    eng = llm.llm_engine
    caches = eng.spec.kv_caches
    scratch = eng.scratch_block * eng.config.block_size
    before = [c.clone() for layer in caches for c in layer]
    eng.spec._warm_up_context()
    after = [c for layer in caches for c in layer]
    for b, a in zip(before, after):
        assert torch.equal(b[:scratch], a[:scratch])
    assert any(not torch.equal(b[scratch:], a[scratch:]) for b, a in zip(before, after))
