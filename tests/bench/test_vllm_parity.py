"""Where `adaspec bench serve` follows `vllm bench serve` in what it measures (a review against
vllm/benchmarks/serve.py): reasoning chunks, arrival processes, goodput, the peak concurrency,
and conditions that are not conditions (where a prompt file lay)."""
import math

import pytest

from adaspec.bench.client import RequestResult, _chunk_text, arrival_offsets
from adaspec.bench.metrics import compute_metrics, peak_in_flight
from adaspec.bench.point_conditions import mixed_settings
from adaspec.bench.runner import BenchConfig, BenchError, run_benchmark


def test_reasoning_chunks_carry_tokens_and_the_role_chunk_does_not():
    chat = "chat"
    assert _chunk_text({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, chat) is None
    assert _chunk_text({"delta": {"reasoning": "let me think"}, "finish_reason": None}, chat) == "let me think"
    assert _chunk_text({"delta": {"reasoning_content": "hm"}, "finish_reason": None}, chat) == "hm"
    # vLLM's first chunk of a reasoning model may carry the role beside the first thought
    assert _chunk_text({"delta": {"role": "assistant", "content": "", "reasoning": "so"}}, chat) == "so"
    assert _chunk_text({"delta": {"content": "x"}}, chat) == "x"
    assert _chunk_text({"delta": {}, "finish_reason": "stop"}, chat) == ""


def test_arrivals_follow_vllms_gamma_process_and_its_limits():
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]  # closed loop
    assert arrival_offsets(4, 2.0, math.inf, 0) == [0.0, 0.5, 1.0, 1.5]  # infinite shape: constant gaps
    offs = arrival_offsets(2001, 4.0, 1.0, 7)
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    assert 0.23 < sum(gaps) / len(gaps) < 0.27  # mean 1 / rate
    for rate, shape in ((0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (2.0, 0.0), (2.0, -0.5)):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, shape, 0)
        with pytest.raises(BenchError, match="must be > 0"):  # before anything is sent
            run_benchmark(BenchConfig(base_url="http://127.0.0.1:9", model="m", prompts=["x"], request_rate=rate,
                                      burstiness=shape, progress=False))


def _req(send, ttft, e2el, tokens, ok=True):
    r = RequestResult(success=ok, output_tokens=tokens, send_time=send, end_time=send + e2el)
    r.chunk_times = [send + ttft, send + e2el] if ok else []
    return r


def test_goodput_counts_the_requests_that_meet_every_slo():
    rs = [_req(0.0, 0.05, 1.05, 11),   # TTFT 50 ms, TPOT 100 ms
          _req(0.0, 0.30, 0.40, 11),   # TTFT 300 ms, TPOT 10 ms
          _req(0.0, 0.05, 0.15, 11),   # TTFT 50 ms, TPOT 10 ms: meets both
          _req(0.0, 0.05, 0.05, 1),    # one token: TPOT 0 (vLLM's), TTFT 50 ms: meets both
          _req(0.0, 0.0, 0.0, 0, ok=False)]
    m = compute_metrics(rs, 2.0, goodput={"ttft": 100.0, "tpot": 20.0})
    assert m["request_goodput"] == pytest.approx(2 / 2.0)
    assert compute_metrics(rs, 2.0, goodput={"e2el": 400.0})["request_goodput"] == pytest.approx(3 / 2.0)
    # TPOT excludes the first token: 100 ms over 10 gaps is 10 ms, over the 11 tokens it would be 9.1
    assert compute_metrics(rs, 2.0, goodput={"tpot": 9.5})["request_goodput"] == pytest.approx(1 / 2.0)
    assert compute_metrics(rs, 2.0)["request_goodput"] is None


def test_peak_concurrency_counts_successful_requests_only():
    ok = [_req(0.0, 0.1, 1.0, 3), _req(0.5, 0.1, 1.0, 3)]
    failed = [_req(0.2, 0, 0, 0, ok=False), _req(0.3, 0, 0, 0, ok=False)]
    for f in failed:
        f.end_time = 0.9
    assert peak_in_flight(ok + failed) == 2


def _point(path, sha):
    return {"arm": "none", "concurrency": 1, "repeat": 0,
            "conditions": {"prompts": {"dataset": "eval-code", "path": path}, "prompts_sha256": sha}}


def test_where_the_prompt_file_lay_is_no_condition_but_its_content_is():
    assert mixed_settings([_point("/a/eval-code.jsonl", "s1"), _point("/b/eval-code.jsonl", "s1")]) == []
    assert set(mixed_settings([_point("/a/eval-code.jsonl", "s1"), _point("/a/eval-code.jsonl", "s2")])) == \
        {"prompts sha256"}
    # without a content hash (older points) the path is all there is to compare
    old = [_point("/a/x.jsonl", None), _point("/b/x.jsonl", None)]
    assert mixed_settings(old) == ["prompts"]


def test_each_phase_of_a_moving_load_has_its_goodput():
    from adaspec.bench.phases import Phase, phase_metrics

    rs = [_req(0.0, 0.05, 0.15, 11), _req(0.0, 0.30, 0.40, 11), _req(1.0, 0.05, 0.15, 11)]
    out = phase_metrics(rs, [0, 0, 1], [Phase(2, 2), Phase(1, 1)], 0.0, goodput={"ttft": 100.0})
    assert [p["request_goodput"] for p in out] == [pytest.approx(1 / 0.4), pytest.approx(1 / 0.15)]
    assert phase_metrics(rs, [0, 0, 1], [Phase(2, 2), Phase(1, 1)], 0.0)[0]["request_goodput"] is None


def test_no_accepted_series_at_all_still_gives_a_calibration_ratio_of_zero():
    from adaspec.bench.specstats import spec_delta

    d = spec_delta({}, {"drafts": 4.0, "accepted_tokens": 0.0, "draft_tokens": 12.0,
                        "verified_per_pos": {0: 4.0, 1: 2.0}, "predicted_per_pos": {0: 3.0, 1: 1.0}})
    assert d["spec_accepted_per_pos"] == [0.0, 0.0] and d["spec_calibration_ratio"] == 0.0


def test_random_prompts_count_the_special_tokens_a_server_adds(tmp_path):
    """vLLM's random dataset: --random-input-len N is the prompt the server runs, its BOS included."""
    import shutil

    from tokenizers import Tokenizer

    from adaspec.bench.dataset import random_prompts
    from adaspec.models.registry import resolve_model_path
    from adaspec.testing import add_bos_post_processor

    d = tmp_path / "tok"
    shutil.copytree(resolve_model_path("tiny"), d)
    add_bos_post_processor(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    for p in random_prompts(3, 16, 0, str(d)):
        assert len(tok.encode(p, add_special_tokens=True).ids) == 16
    plain = random_prompts(2, 16, 0, "tiny")  # no special tokens: 16 words' tokens
    assert all(len(Tokenizer.from_file(str(resolve_model_path("tiny") / "tokenizer.json")).encode(
        p, add_special_tokens=False).ids) == 16 for p in plain)
    with pytest.raises(Exception, match="leaves no room"):
        random_prompts(1, 1, 0, str(d))
