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


def test_token_margin_is_the_distance_to_the_engines_own_token():
    """The engine's token judged, not the float64 draw's: the same as draw_margin where they agree,
    else how far u * total lies from the engine token's CDF interval (a float32 neighbour of the
    draw lies within rounding of it, a token drawn with another uniform far away)."""
    from adaspec.spec_decode.lockstep import token_margin

    w = torch.tensor([0.25, 0.25, 0.5])  # boundaries 0.25, 0.5; u = 0.3 draws token 1
    assert token_margin(w, 0.3, 1) == pytest.approx(draw_margin(w, 0.3)) == pytest.approx(0.05)
    assert token_margin(w, 0.3, 0) == pytest.approx(0.05)  # [0, 0.25) ends 0.05 below u * total
    assert token_margin(w, 0.3, 2) == pytest.approx(0.2)  # [0.5, 1) starts 0.2 above it
    rare = torch.tensor([0.5, 1e-7, 2e-7, 0.5])  # a cluster of rare tokens at u = 0.5
    assert token_margin(rare, 0.5 + 1.5e-7 / 1.0000003, 3) < NEAR_TIE
    assert token_margin(torch.zeros(3), 0.5, 1) == float("inf")


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
    and uniform give that token again: with a uniform for the wrong position no draw is a near-tie."""
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
    assert all(m >= NEAR_TIE for m in wrong) and sum(m > 10 * NEAR_TIE for m in wrong) >= len(reqs) // 2, wrong


def _tiny_prompts(n: int) -> list[list[int]]:  # test_cuda_graphs_gpu._prompts(n)
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 8000, (int(L),), generator=g).tolist() for L in torch.randint(5, 60, (n,), generator=g)]


def test_draw_margin_after_judges_every_draw_of_a_plain_engines_run(monkeypatch):
    """Any output token of a plain engine's seeded run (top-p rows too), replayed alone with the
    tokens before it as prompt: the same token, at a margin in [0, 1); with a uniform keyed to the
    wrong position no draw is a near-tie (the tokens lie far from it), so the replay's position is
    the run's."""
    from adaspec import LLM, SamplingParams
    from adaspec.spec_decode.lockstep import draw_margin_after

    eng = LLM("tiny", enforce_eager=True, dtype="float32", device="cpu").llm_engine
    prompts = _tiny_prompts(6)
    params = [SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, max_tokens=6, ignore_eos=True, seed=i)
              for i in range(6)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[int(o.request_id)] = list(o.outputs[0].token_ids)
    judged = [(i, j, draw_margin_after(eng, prompts[i], out[i][:j], params[i])) for i in range(6) for j in (0, 3, 5)]
    assert [t for _, _, (t, _) in judged] == [out[i][j] for i, j, _ in judged]
    assert all(0 <= m < 1 for _, _, (_, m) in judged), judged
    real = lockstep._u
    monkeypatch.setattr(lockstep, "_u", lambda seed, pos, stream, anchor=None: real(seed, pos + 1, stream, anchor))
    wrong = [draw_margin_after(eng, prompts[i], out[i][:j], params[i])[1] for i, j, _ in judged]
    assert all(m >= NEAR_TIE for m in wrong) and sum(m > 10 * NEAR_TIE for m in wrong) >= len(judged) // 2, wrong
    with pytest.raises(ValueError, match="presence / frequency penalties"):
        draw_margin_after(eng, prompts[0], out[0][:2], replace(params[0], frequency_penalty=0.5))


def test_the_plain_graphed_engines_parting_on_an_h100_is_a_near_tie():
    """H100 run 50: the plain graphed engine at T = 1 (tests/engine/test_cuda_graphs_gpu.py,
    test_graphs_match_eager) drew token 4863 where the eager engine drew 4867, request 10's output
    token 10, after ten equal tokens. Replayed on the CPU in float32 from the H100 eager engine's
    tokens: a third token (4865) at a margin under 1e-6, three CDF boundaries within rounding of the
    uniform, while the draws before and after it (262, 1393) are the H100's at wide margins."""
    from adaspec import LLM, SamplingParams
    from adaspec.spec_decode.lockstep import draw_margin_after

    eager_h100 = [4939, 11, 86, 798, 72, 1362, 11, 69, 5, 262, 4867, 1393, 261]
    params = SamplingParams(temperature=1.0, max_tokens=23, ignore_eos=True, seed=10)
    eng = LLM("tiny", enforce_eager=True, dtype="float32", device="cpu").llm_engine
    prompt = _tiny_prompts(19)[10]
    token, margin = draw_margin_after(eng, prompt, eager_h100[:10], params)
    assert 4863 <= token <= 4867 and margin < NEAR_TIE, (token, margin)
    # both H100 engines' tokens lie within rounding of the CPU's uniform too
    tap = lockstep._EagerTap(eng)
    try:
        eng.add_request("again", prompt + eager_h100[:10], replace(params, max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        tap.remove()
    s = tap.plain["again"]
    u = _u(s["seed"], s["pos"], lockstep.SAMPLE)
    # "within rounding" here allows 10x NEAR_TIE: the CPU's float32 CDF over the vocabulary moves
    # with its kernels' summation order (on a development CPU without AVX-512, 2026-12-07: 4867
    # drawn at 2.5e-7 and 4863 at 1.6e-6), still two orders below the wide draws checked below
    assert all(lockstep.token_margin(s["probs"], u, t) < 10 * NEAR_TIE for t in (4863, 4867))
    assert lockstep.token_margin(s["probs"], u, 262) > 1e-3  # a token far from the uniform is not
    for j in (9, 11):
        token, margin = draw_margin_after(eng, prompt, eager_h100[:j], params)
        assert token == eager_h100[j] and margin > 100 * NEAR_TIE, (j, token, margin)
