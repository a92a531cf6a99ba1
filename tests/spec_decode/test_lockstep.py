"""The lockstep divergence check (spec_decode/lockstep.py) that the GPU test of seeded sampling
relies on: on the tiny pair with the graphed functions run eagerly (CPU), divergences between the
graphed and the eager step are near-ties only; a graphed step that draws with the wrong seed is
caught as logic differences; the margins themselves are exact on hand-made cases."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from adaspec.spec_decode import graphed_step
from adaspec.spec_decode import lockstep
from adaspec.spec_decode.lockstep import (NEAR_TIE, _u, accept_margin, draw_margin, filter_margin, first_draw_margin,
                                         run_lockstep)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from graph_divergence_check import engine, requests  # noqa: E402


def test_draw_margin_is_the_distance_to_the_nearest_boundary():
    w = torch.tensor([0.25, 0.25, 0.5])
    assert draw_margin(w, 0.3) == pytest.approx(0.05)  # boundaries at 0.25 and 0.5
    assert draw_margin(w, 0.5) == pytest.approx(0.0)
    assert draw_margin(w * 4, 0.9) == pytest.approx(0.1)  # unnormalized weights: a fraction of the total
    assert accept_margin(0.5, 1.0, 0.25) == pytest.approx(0.5)
    assert accept_margin(0.2, 0.4, 0.5) == pytest.approx(0.0)


def test_filter_margin_is_the_cutoffs_distance_to_a_tie():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()  # preceding sorted masses 0, 0.5, 0.8
    assert filter_margin(logits, 1.0, 0.75, 0) == pytest.approx(0.05)
    assert filter_margin(logits, 1.0, 0.8, 0) == pytest.approx(0.0, abs=1e-7)  # float32 logits
    assert filter_margin(torch.tensor([3.0, 2.0, 1.9]), 1.0, 1.0, 2) == pytest.approx(0.1 / 2.0)  # k-th vs next logit
    assert filter_margin(torch.tensor([0.5, 0.02, 0.01]), 1.0, 1.0, 2) == pytest.approx(0.01)  # near 0: absolute
    # the first token is kept whatever top_p is: a tiny top_p is no near-tie of its (empty) preceding mass
    assert filter_margin(logits, 1.0, 1e-9, 0) == pytest.approx(0.5)
    assert filter_margin(logits, 1.0, 1.0, 0) == float("inf")  # no filter: nothing to judge
    assert filter_margin(logits, 0.0, 0.5, 0) == float("inf")  # greedy: the argmax decides
    # the temperature scales before the cut: at T = 2 the masses are those of sqrt-weights
    half = torch.softmax(logits.double() / 2, 0)
    assert filter_margin(logits, 2.0, 0.5, 0) == pytest.approx(abs(float(half[0]) - 0.5))


def test_a_first_token_parted_at_a_top_p_cutoff_is_a_near_tie():
    """H200 run 40 (and runs 36-37): the busy-GPU pipelined test's request 12, a top-p 0.9 row,
    drew 2732 on one engine and 2739 on the other, at a draw margin of 4.5e-5, far above rounding;
    its top-p cutoff lies ~2e-7 from 0.9, so the token set itself is decided by rounding. The
    margin first_draw_margin reports is that near-tie, not the draw's."""
    from adaspec import LLM, SamplingParams

    g = torch.Generator().manual_seed(19)  # test_cuda_graphs_gpu._prompts(19)
    prompts = [torch.randint(1, 8000, (int(n),), generator=g).tolist() for n in torch.randint(5, 60, (19,), generator=g)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, seed=12, ignore_eos=True)
    llm = LLM("tiny", speculative_config={"method": "dspark", "num_speculative_tokens": 5}, enforce_eager=True,
              dtype="float32")
    eng = llm.llm_engine
    token, margin = first_draw_margin(eng, prompts[12], params)
    assert token is not None and margin < NEAR_TIE
    # the draw alone is far from a tie: the filter explains the parting, nothing else does
    tap = lockstep._EagerTap(eng)
    try:
        eng.add_request("again", prompts[12], replace(params, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        tap.remove()
    s = tap.plain["again"]
    assert draw_margin(s["probs"], _u(s["seed"], s["pos"], lockstep.SAMPLE)) > 10 * NEAR_TIE


def test_graphed_step_parts_from_eager_only_at_near_ties():
    found, n = run_lockstep(engine(False, "cpu", 5), engine(True, "cpu", 5), requests(19, 19))
    assert all(d.explained() for d in found), [d for d in found if not d.explained()]
    assert len(found) <= 2, f"{len(found)} of {n} requests differ"


def test_a_graphed_step_with_the_wrong_seed_is_caught(monkeypatch):
    original = graphed_step.rejection_sample

    def wrong_seed(draft_tokens, num_verify, p, q, greedy, seeds, anchors, **kw):
        return original(draft_tokens, num_verify, p, q, greedy, seeds + 1, anchors, **kw)

    monkeypatch.setattr(graphed_step, "rejection_sample", wrong_seed)
    found, n = run_lockstep(engine(False, "cpu", 5), engine(True, "cpu", 5), requests(12, 20))
    assert len(found) > n // 2
    assert sum(not d.explained(NEAR_TIE) for d in found) > n // 2


def test_first_draw_margin_judges_the_draw_the_engine_made(monkeypatch):
    """The first token of one request alone, with its draw's margin: the token is the one a whole
    run gives (top-p rows included), and the margin is judged only when the recorded probabilities
    and uniform give that token again: a uniform for the wrong position judges nothing (inf)."""
    eng = engine(False, "cpu", 5)
    reqs = [(rid, prompt, replace(params, top_p=0.9) if n % 2 else params)
            for n, (rid, prompt, params) in enumerate(requests(6, 21))]
    for rid, prompt, params in reqs:
        eng.add_request(rid, prompt, params)
    first = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, o.outputs[0].token_ids[0])
    judged = [first_draw_margin(eng, prompt, params) for _, prompt, params in reqs]
    assert [t for t, _ in judged] == [first[rid] for rid, _, _ in reqs]
    assert all(0 <= m < 1 for _, m in judged), judged
    real = lockstep._u
    monkeypatch.setattr(lockstep, "_u", lambda seed, pos, stream, anchor=None: real(seed, pos + 1, stream, anchor))
    wrong = [first_draw_margin(eng, prompt, params)[1] for _, prompt, params in reqs]
    assert sum(m == float("inf") for m in wrong) >= len(reqs) // 2, wrong
