"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs captured per rank with the all-reduces inside)
against one GPU, for the no-spec, fixed-k and adaptive arms. Skipped without 2 CUDA devices.

Why bfloat16 outputs are not asserted token for token: TP = 2 computes the same function in
another order. Each rank's o_proj and down_proj sum half of the input dimension and the
all-reduce adds the halves, the LM head is split by vocabulary, and cuBLAS picks other kernels
(split-K and tile shapes) for the halved matrices. In bf16 (8 mantissa bits, activations rounded
after every op) the logits then differ in the second or third digit, and greedy decoding rightly
takes the other branch wherever the top two tokens are that close; after that the continuations
share nothing. Exact bf16 equality failed on the first two-H200 run (BENCHMARKS.md) and would
fail on any near-tie, so it says nothing about correctness. What is asserted instead:
- float32: greedy tokens and seeded samples equal TP = 1's exactly, as in the CPU tests
  (tests/distributed/test_tp_engine.py): a rounding difference of ~1e-6 does not flip a choice
  in practice. This is the strict check of the sharding, the collectives in the graphs and the
  mirroring of every call.
- bfloat16: per request, tokens agree up to a first divergence, and there TP = 1's own logprobs
  put both tokens within BF16_TIE nats (a near-tie that rounding may flip); before it the chosen
  tokens' logprobs agree within BF16_LOGPROB_TOL; and most tokens lie before any divergence.
  A real fault (a wrong shard, a missing all-reduce, a stale graph input) moves logits by O(1)
  and fails these.

Each case runs in its own Python process: after NCCL work captured in CUDA graphs,
torch.distributed.destroy_process_group can hang (the engine gives it up after 10 s and leaves the
group behind, adaspec/distributed/context.py), and a process that still belongs to a group cannot
start another tensor-parallel engine; on the first two-GPU run of this version the third case
failed on exactly that. So the pytest process starts no engine itself.
"""
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from adaspec import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]

PROMPTS = ["def add(a, b):", "import numpy as np\n", [5, 6, 7, 8, 9], "class Stack:\n    def push(self, x):"] * 4
ARMS = {
    "nospec": None,
    "nospec-async": None,  # async scheduling: the previous step's tokens reach the worker over NCCL
    "fixed": {"method": "dspark", "num_speculative_tokens": 7},
    "adaptive": {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": True},
}
# The tolerances: bf16 logits near 10 are spaced 0.0625 apart, so exact ties occur (the CPU run
# below showed top-2 margins of 0.0); on CPU (gloo, bf16, tiny pair, 4 prompts x 64 tokens, no
# spec and fixed k) TP = 2 chose TP = 1's tokens throughout with chosen-token logprobs at most
# 0.064 nats apart. 0.3 nats leaves room for other GPU kernels; a fault moves them by whole nats.
BF16_TIE = 0.3  # nats: how close TP = 1 must rate the two tokens where bf16 greedy paths part
BF16_LOGPROB_TOL = 0.3  # nats: chosen-token logprobs of the two sizes while their paths agree
BF16_MIN_SHARED = 0.5  # fraction of all generated tokens that must lie before a divergence


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _fresh_policy(spec, cost_model):
    from adaspec.spec_decode.policy import AdaptivePolicy

    spec.policy = AdaptivePolicy(cost_model, spec.num_spec_tokens, spec.cfg.adaptive_verification_ema_alpha)


def _kw(arm, dtype, tmp_path):
    spec = ARMS[arm] and {**ARMS[arm], "cost_model_cache_dir": str(tmp_path)}
    return dict(device="cuda", dtype=dtype, max_num_seqs=16, max_model_len=512, speculative_config=spec,
                async_scheduling=True if arm.endswith("async") else None)


def _in_own_process(case: str, arm: str, tmp_path) -> None:
    """Run _CASES[case](arm, tmp_path) in a fresh interpreter; its failure fails this test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                                     os.environ.get("PYTHONPATH")]))}
    # its own session: on a timeout the whole group goes (the case's TP workers too)
    proc = subprocess.Popen([sys.executable, __file__, case, arm, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        err = proc.communicate()[1] + "\n(test: killed after 900 s)"
    if proc.returncode != 0:
        at = err.rfind("Traceback (most recent call last)")  # the failure, ahead of teardown noise
        pytest.fail(f"{case} {arm} failed in its own process (exit {proc.returncode}):\n"
                    f"{err[at:][:6000] if at >= 0 else err[-6000:]}")


@pytest.mark.parametrize("arm", list(ARMS))
def test_tp2_float32_equals_tp1(arm, tmp_path):
    _in_own_process("float32", arm, tmp_path)


@pytest.mark.parametrize("arm", [a for a in ARMS if not a.endswith("async")])
def test_tp2_bf16_stays_within_rounding_of_tp1(arm, tmp_path):
    _in_own_process("bf16", arm, tmp_path)


def _float32_case(arm, tmp_path):
    kw = _kw(arm, "float32", tmp_path)
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


def _compare_bf16(ref, got):
    """-> (problems, tokens before the first divergence, all tokens); see the module's docstring."""
    problems, shared, total = [], 0, 0
    for r, (a, b) in enumerate(zip(ref, got)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        total += len(ta)
        j = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        shared += j
        for i in range(j):
            if abs(la[i][ta[i]] - lb[i][tb[i]]) > BF16_LOGPROB_TOL:
                problems.append(f"request {r} token {i}: logprob {la[i][ta[i]]:.3f} (TP=1) vs {lb[i][tb[i]]:.3f}")
        if j < min(len(ta), len(tb)):
            if tb[j] not in la[j]:
                problems.append(f"request {r} token {j}: TP=2 chose {tb[j]}, outside TP=1's top {len(la[j]) - 1}")
            elif la[j][ta[j]] - la[j][tb[j]] > BF16_TIE:
                problems.append(f"request {r} token {j}: paths part where TP=1 rates {ta[j]} "
                                f"{la[j][ta[j]] - la[j][tb[j]]:.3f} nats above TP=2's {tb[j]}: not a near-tie")
    return problems, shared, total


def _bf16_case(arm, tmp_path):
    kw = _kw(arm, "bfloat16", tmp_path)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    one = LLM("tiny", **kw)
    ref = one.generate(PROMPTS, greedy)
    del one
    torch.cuda.empty_cache()
    two = LLM("tiny", tensor_parallel_size=2, **kw)
    try:
        assert two.llm_engine.runner.graphs is not None
        problems, shared, total = _compare_bf16(ref, two.generate(PROMPTS, greedy))
    finally:
        two.llm_engine.shutdown()
    assert not problems, "\n".join(problems)
    assert shared >= BF16_MIN_SHARED * total, f"only {shared} of {total} tokens before the paths part"


_CASES = {"float32": _float32_case, "bf16": _bf16_case}

if __name__ == "__main__":  # one case, in its own process (see the module docstring)
    try:
        _CASES[sys.argv[1]](sys.argv[2], sys.argv[3])
    except BaseException:  # noqa: BLE001 - reported to the parent test through stderr and the exit code
        traceback.print_exc()
        sys.exit(1)
