"""A seeded request's text does not depend on its batch (README, "Seeds: what is reproducible"):
without speculation and with fixed k, alone or among other requests, in any order, with
preemption forcing recomputes."""
import pytest

from adaspec import LLM, SamplingParams

PROMPTS = ["def fib(n):", "import os\n", "class Foo:", "for i in range("]
OTHERS = ["def main():\n", "print(", "while True:", "return ", "x = [", "# compute"]


def seeded(i):
    return SamplingParams(temperature=1.0, top_p=0.95, top_k=50, max_tokens=40, seed=1000 + i, ignore_eos=True)


def other(i):
    return SamplingParams(temperature=0.8, max_tokens=20 + 7 * i, ignore_eos=True)


@pytest.fixture(scope="module", params=["none", "fixed"])
def llms(request, tmp_path_factory):
    spec = None
    if request.param == "fixed":
        spec = {"method": "dspark", "num_speculative_tokens": 5}
    roomy = LLM("tiny", speculative_config=spec, max_num_seqs=16)
    # a cache of 10 blocks of 16 tokens cannot hold 10 requests of 25-60 tokens: preemption
    tight = LLM("tiny", speculative_config=spec, max_num_seqs=16, num_kv_blocks=10, max_model_len=128)
    return request.param, roomy, tight


def test_seeded_output_independent_of_batch(llms):
    arm, roomy, tight = llms
    alone = [roomy.generate([p], seeded(i))[0].outputs[0].token_ids for i, p in enumerate(PROMPTS)]
    assert len({tuple(a) for a in alone}) == len(alone)
    mixed_prompts = OTHERS[:3] + PROMPTS + OTHERS[3:]
    mixed_params = [other(i) for i in range(3)] + [seeded(i) for i in range(len(PROMPTS))] + \
        [other(i) for i in range(3, len(OTHERS))]
    for llm in (roomy, tight):
        outs = llm.generate(mixed_prompts, mixed_params)
        assert [o.outputs[0].token_ids for o in outs[3:3 + len(PROMPTS)]] == alone, arm
        rev = llm.generate(mixed_prompts[::-1], mixed_params[::-1])[::-1]
        assert [o.outputs[0].token_ids for o in rev[3:3 + len(PROMPTS)]] == alone, arm
    assert tight.llm_engine.stats.num_preemptions > 0  # the tight cache really recomputed


def test_unseeded_requests_differ(llms):
    _, roomy, _ = llms
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    a, b = roomy.generate(["def fib(n):"] * 2, params)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_unseeded_requests_follow_torch_manual_seed_without_an_engine_seed(monkeypatch):
    """seed=None: unseeded requests draw their seeds from torch's global generator, all the
    requests added since the last step in one call: torch.manual_seed makes a run repeatable."""
    import torch

    import adaspec.engine.llm_engine as llm_engine

    calls = []
    real = llm_engine.new_seeds
    monkeypatch.setattr(llm_engine, "new_seeds", lambda n, gen: calls.append((n, gen)) or real(n, gen))
    llm = LLM("tiny", max_num_seqs=8, seed=None)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def run(seed):
        torch.manual_seed(seed)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    first = run(7)
    assert calls == [(len(PROMPTS), None)]  # one draw for the four requests, from the global generator
    assert run(7) == first and run(8) != first
    assert len({tuple(t) for t in first}) == len(PROMPTS)


def test_the_engine_seed_makes_a_run_of_unseeded_requests_repeat():
    """vLLM's engine seed (default 0): a fresh engine's unseeded requests get the same seeds run
    after run, whatever torch's global generator did; another engine seed, other text."""
    import torch

    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def run(**kw):
        llm = LLM("tiny", max_num_seqs=8, **kw)
        torch.manual_seed(len(kw))  # no influence
        return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] for _ in range(2)]

    first, again = run(), run(seed=0)
    assert first == again
    assert first[0] != first[1]  # one engine's second run draws further
    assert run(seed=5)[0] != first[0]
