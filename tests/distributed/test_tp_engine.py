"""The engine at tensor_parallel_size=2 (gloo, 2 CPU processes) produces the tokens it produces
at size 1: greedy for the no-spec, fixed-k and adaptive arms, and seeded sampling."""
import json

import pytest

from adaspec import LLM, SamplingParams
from adaspec.errors import ConfigError
from adaspec.testing import pin_cost_tables

PROMPTS = ["def add(a, b):", "import numpy as np\n", [5, 6, 7, 8, 9], "class Stack:\n    def push(self, x):"]
ARMS = {
    "nospec": None,
    # async scheduling: step t's inputs come from step t-1's sampled tokens, which reach the
    # worker inside the mirrored call (engine/async_step.py)
    "nospec-async": None,
    "fixed": {"method": "dspark", "num_speculative_tokens": 4},
    "adaptive": {"method": "dspark", "num_speculative_tokens": 5, "enable_adaptive_verification": True,
                 "profile_repeats": 1},
}


def _kw(arm, tmp_path):
    spec = ARMS[arm]
    if spec is not None:
        spec = {**spec, "cost_model_cache_dir": str(tmp_path)}
    return dict(device="cpu", max_num_seqs=4, num_kv_blocks=96, max_model_len=512, max_num_batched_tokens=64,
                speculative_config=spec)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=list(ARMS))
def pair(request, tmp_path_factory):
    """(arm, TP=1 LLM, TP=2 LLM); the workers stop at teardown."""
    arm = request.param
    cache = tmp_path_factory.mktemp(f"cost-{arm}")
    kw = _kw(arm, cache)
    one = LLM("tiny", **kw)
    two = LLM("tiny", tensor_parallel_size=2, async_scheduling=arm.endswith("async") or None, **kw)
    assert two.llm_engine.async_scheduling == arm.endswith("async")
    if arm == "adaptive":  # both profiled (no shared cached tables): the TP size is part of the key
        keys = [json.loads(f.read_text())["key"] for f in cache.glob("cost_model_*.json")]
        assert sorted(k["tensor_parallel_size"] for k in keys) == [1, 2]
        for llm in (one, two):  # their drafts must run whatever this machine's load makes of the tables
            pin_cost_tables(llm)
    yield arm, one, two
    two.llm_engine.shutdown()


def test_greedy_equals_tp1(pair):
    arm, one, two = pair
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = (one.llm_engine.stats.num_accepted_tokens, two.llm_engine.stats.num_accepted_tokens)
    eng = two.llm_engine
    runner, from_device = eng.runner, []

    class Spy:  # which forwards took inputs from the previous step's tokens on the device
        def __getattr__(self, name):
            return getattr(runner, name)

        def execute(self, items, *args, **kw):
            from_device.append(sum(it.prev_row >= 0 for it in items))
            return runner.execute(items, *args, **kw)

    eng.runner = Spy()
    try:
        assert _tokens(two.generate(PROMPTS, p)) == _tokens(one.generate(PROMPTS, p))
    finally:
        eng.runner = runner
    stats = eng.stats
    # async: every decode step's inputs came from the step before, on the device (through the workers too)
    assert (sum(n == len(PROMPTS) for n in from_device) >= 35) == arm.endswith("async")
    if not arm.startswith("nospec"):  # speculation really ran on the sharded drafter
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > before[1]
    if arm == "fixed":  # greedy output is the same whatever the drafts: the same acceptance says the drafts are
        assert stats.num_accepted_tokens - before[1] == one.llm_engine.stats.num_accepted_tokens - before[0]


def _same_fresh_policies(one, two):
    """Sampled outputs depend on the verify lengths, which the adaptive policy picks from timed
    cost tables: give both engines fresh policies over the size-1 engine's tables, so that they decide alike."""
    from adaspec.spec_decode.policy import AdaptivePolicy

    a, b = one.llm_engine.spec, two.llm_engine.spec
    for spec in (a, b):
        spec.policy = AdaptivePolicy(a.cost_model, spec.num_spec_tokens, spec.cfg.adaptive_verification_ema_alpha)


def test_seeded_sampling_equals_tp1(pair):
    arm, one, two = pair
    if arm == "adaptive":
        _same_fresh_policies(one, two)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=30, ignore_eos=True)
              for i in range(len(PROMPTS))]
    assert _tokens(two.generate(PROMPTS, params)) == _tokens(one.generate(PROMPTS, params))


@pytest.mark.parametrize("size, match", [(3, "does not divide the 4 attention heads"),
                                         (0, "tensor_parallel_size must be a positive integer")])
def test_bad_sizes_are_refused_before_any_process_starts(size, match):
    with pytest.raises(ConfigError, match=match):
        LLM("tiny", device="cpu", tensor_parallel_size=size)

