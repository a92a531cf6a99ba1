"""Pure pieces: SSE parsing, weighted percentiles, /metrics parsing, prompt sets, arrivals."""
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest

from adaspec.bench import dataset
from adaspec.bench.client import arrival_offsets
from adaspec.bench.metrics import weighted_percentile
from adaspec.bench.specstats import engine_delta, parse_spec_counters, spec_delta
from adaspec.bench.sse import SSEParser


@given(st.lists(st.integers(1, 40), min_size=1, max_size=20))
def test_sse_any_split(cuts):
    stream = b'data: {"a": 1}\r\n\r\n: ping\n\nevent: x\ndata: {"b":\ndata: "\xc3\xa9"}\n\ndata: [DONE]\n\n'
    p, got, pos = SSEParser(), [], 0
    for c in cuts:
        got += p.feed(stream[pos:pos + c])
        pos += c
    got += p.feed(stream[pos:]) + p.close()
    assert got == ['{"a": 1}', '{"b":\n"é"}', "[DONE]"]


def test_sse_unterminated_last_event():
    p = SSEParser()
    assert p.feed(b"data: x") == [] and p.close() == ["x"]


@given(st.lists(st.tuples(st.floats(0, 100, allow_nan=False), st.integers(1, 5)), min_size=1, max_size=30),
       st.floats(0, 100))
def test_weighted_percentile_equals_expanded(pairs, q):
    """Integer weights: numpy's linear percentile (vLLM's, and the per-chunk ITL's) of the expanded sample."""
    vals = [v for v, _ in pairs]
    wts = [w for _, w in pairs]
    expanded = [v for v, w in pairs for _ in range(w)]
    assert weighted_percentile(vals, wts, q) == pytest.approx(np.percentile(expanded, q), rel=1e-9, abs=1e-9)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=40), st.floats(0, 100))
def test_weighted_percentile_with_unit_weights_is_numpys(vals, q):
    assert weighted_percentile(vals, [1] * len(vals), q) == pytest.approx(np.percentile(vals, q), rel=1e-9, abs=1e-6)


def test_per_token_and_per_chunk_itl_agree_when_every_chunk_is_one_token():
    """They disagreed (an inverted-CDF weighted percentile against numpy's linear one)."""
    from adaspec.bench.client import RequestResult
    from adaspec.bench.metrics import compute_metrics

    rs = [RequestResult(success=True, output_tokens=len(t), send_time=0.0, chunk_times=t, chunk_tokens=[1] * len(t),
                        end_time=t[-1]) for t in ([0.1, 0.13, 0.2, 0.21], [0.05, 0.3, 0.31, 0.5, 0.57])]
    m = compute_metrics(rs, duration=1.0, percentiles=(10, 25, 90, 99))
    for stat in ("median", "p10", "p25", "p90", "p99"):
        assert m[f"{stat}_itl_token_ms"] == pytest.approx(m[f"{stat}_itl_ms"], rel=1e-12), stat
    assert m["mean_itl_token_ms"] == pytest.approx(m["mean_itl_ms"])


def test_parse_real_prometheus_client_output():
    r = CollectorRegistry()
    for prefix in ("adaspec:", "vllm:"):
        c = Counter(f"{prefix}spec_decode_num_drafts", "d", ["model_name"], registry=r)
        c.labels(model_name="a").inc(3)
        c.labels(model_name="b").inc(2)  # label sets are summed
    pp = Counter("adaspec:spec_decode_num_accepted_tokens_per_pos", "p", ["model_name", "position"], registry=r)
    pp.labels(model_name="a", position="1").inc(4)
    pp.labels(model_name="a", position="0").inc(6)
    Counter("adaspec:spec_decode_num_accepted_tokens", "a", registry=r).inc(10)
    Counter("adaspec:spec_decode_num_draft_tokens", "t", registry=r).inc(20)
    bs = Counter("adaspec:spec_decode_budget_steps", "b", ["budget"], registry=r)
    bs.labels(budget="3").inc(5)
    got = parse_spec_counters(generate_latest(r).decode())
    assert got == {"drafts": 10.0, "accepted_per_pos": {0: 6.0, 1: 4.0}, "accepted_tokens": 10.0,
                   "draft_tokens": 20.0, "budget_steps": {3: 5.0}}
    before = {"drafts": 4.0, "accepted_tokens": 2.0, "draft_tokens": 8.0, "accepted_per_pos": {0: 2.0}}
    d = spec_delta(before, got)
    assert d["spec_num_drafts"] == 6 and d["spec_acceptance_rate"] == pytest.approx(8 / 12)
    assert d["spec_mean_accepted_length"] == pytest.approx(1 + 8 / 6)
    assert d["spec_accepted_per_pos"] == [4.0, 4.0]
    assert d["spec_acceptance_rate_per_pos"] == pytest.approx([4 / 6, 4 / 6])
    assert d["spec_budget_steps"] == {"3": 5.0}
    assert spec_delta(None, got)["spec_num_drafts"] is None


def test_calibration_from_real_prometheus_client_output():
    """Accepted drafts against their predicted survival, per position and over all of them."""
    r = CollectorRegistry()
    acc = Counter("adaspec:spec_decode_num_accepted_tokens_per_pos", "a", ["model_name", "position"], registry=r)
    ver = Counter("adaspec:spec_decode_num_verified_tokens_per_pos", "v", ["model_name", "position"], registry=r)
    pred = Counter("adaspec:spec_decode_predicted_accepted_tokens_per_pos", "p", ["model_name", "position"], registry=r)
    for pos, (a, v, q) in enumerate([(8, 10, 9.0), (3, 8, 6.0), (0, 0, 0.0)]):
        acc.labels(model_name="m", position=str(pos)).inc(a)
        ver.labels(model_name="m", position=str(pos)).inc(v)
        pred.labels(model_name="m", position=str(pos)).inc(q)
    got = parse_spec_counters(generate_latest(r).decode())
    assert got["verified_per_pos"] == {0: 10.0, 1: 8.0, 2: 0.0}
    assert got["predicted_per_pos"] == {0: 9.0, 1: 6.0, 2: 0.0}
    before = {"accepted_per_pos": {0: 2.0, 1: 1.0}, "verified_per_pos": {0: 4.0, 1: 2.0},
              "predicted_per_pos": {0: 3.0, 1: 2.0}}
    d = spec_delta(before, got)
    assert d["spec_verified_per_pos"] == [6.0, 6.0, 0.0]
    assert d["spec_predicted_per_pos"] == [6.0, 4.0, 0.0]
    # realized 6 and 2 accepted against 6 and 4 predicted; a position never verified has no ratio
    assert d["spec_calibration_ratio_per_pos"] == [pytest.approx(1.0), pytest.approx(0.5), None]
    assert d["spec_calibration_ratio"] == pytest.approx(8 / 10)
    # a server without the calibration counters (vLLM): no ratio, nothing invented
    plain = {"accepted_per_pos": {0: 5.0}, "drafts": 5.0}
    assert spec_delta({}, plain)["spec_calibration_ratio"] is None
    # a position verified but never accepted has no accepted series yet (a labelled counter shows
    # once it moves): counted 0, so the ratios still come out
    late = {"drafts": 4.0, "accepted_per_pos": {0: 3.0}, "verified_per_pos": {0: 4.0, 1: 2.0},
            "predicted_per_pos": {0: 3.0, 1: 1.0}}
    d = spec_delta({}, late)
    assert d["spec_accepted_per_pos"] == [3.0, 0.0] and d["spec_acceptance_rate_per_pos"] == [0.75, 0.0]
    assert d["spec_calibration_ratio_per_pos"] == [pytest.approx(1.0), pytest.approx(0.0)]
    assert d["spec_calibration_ratio"] == pytest.approx(3 / 4)


def test_engine_steps_from_real_prometheus_client_output():
    r = CollectorRegistry()
    steps = Counter("adaspec:engine_steps", "s", ["model_name"], registry=r)
    secs = Counter("adaspec:engine_step_seconds", "t", ["model_name"], registry=r)
    Counter("adaspec:spec_decode_draft_skipped_steps", "k", registry=r).inc(7)  # not the engine's steps
    Counter("adaspec:spec_decode_budget_steps", "b", ["budget"], registry=r).labels(budget="3").inc(5)
    steps.labels(model_name="m").inc(250)
    secs.labels(model_name="m").inc(1.5)
    got = parse_spec_counters(generate_latest(r).decode())
    assert got["engine_steps"] == 250.0 and got["engine_step_seconds"] == pytest.approx(1.5)
    d = engine_delta({"engine_steps": 50.0, "engine_step_seconds": 0.5}, got, duration=2.0, output_tokens=800)
    assert d == pytest.approx({"engine_steps": 200.0, "engine_step_seconds": 1.0, "engine_mean_step_ms": 5.0,
                               "engine_output_tokens_per_step": 4.0, "engine_busy_fraction": 0.5})
    # a server without these counters (vLLM, or no /metrics): unknown, not zero
    assert set(engine_delta({}, {"drafts": 1.0}, 2.0, 10).values()) == {None}
    assert set(engine_delta(None, got, 2.0, 10).values()) == {None}
    only_steps = engine_delta({}, {"engine_steps": 10.0}, 2.0, 40)
    assert only_steps["engine_output_tokens_per_step"] == 4.0 and only_steps["engine_busy_fraction"] is None


def test_datasets(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "one"}) + "\n\n" + json.dumps({"prompt": "two", "x": 1}) + "\n")
    assert dataset.load_prompts("jsonl", 5, str(f)) == ["one", "two", "one", "two", "one"]
    r1 = dataset.load_prompts("random", 3, random_input_len=7, seed=1, tokenizer="tiny")
    assert r1 == dataset.load_prompts("random", 3, random_input_len=7, seed=1, tokenizer="tiny")
    assert r1 != dataset.load_prompts("random", 3, random_input_len=7, seed=2, tokenizer="tiny")
    # --random-input-len counts tokens of the model's tokenizer, as vLLM's random dataset
    from adaspec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(dataset.tokenizer_dir("tiny"))
    for n in (1, 7, 100):
        assert {len(tok.encode(p)) for p in dataset.load_prompts("random", 5, random_input_len=n, tokenizer="tiny")} == {n}
    with pytest.raises(dataset.DatasetError, match="--tokenizer"):
        dataset.load_prompts("random", 1, random_input_len=7, tokenizer=str(tmp_path))
    assert dataset.load_prompts("custom", 3, str(f)) == ["one", "two", "one"]  # vLLM's name for a jsonl
    assert all(len(p.split()) == 7 for p in r1)
    f.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(dataset.DatasetError, match=r"p.jsonl:2"):
        dataset.load_prompts("jsonl", 1, str(f))
    with pytest.raises(dataset.DatasetError, match="not found"):
        dataset.load_prompts("jsonl", 1, str(tmp_path / "nope.jsonl"))


def test_eval_code_is_packaged_or_clearly_missing():
    if dataset.eval_code_path().is_file():
        ps = dataset.load_prompts("eval-code", 3)
        assert len(ps) == 3 and all(isinstance(p, str) and p for p in ps)
    else:
        with pytest.raises(dataset.DatasetError, match="eval-code prompt set is missing"):
            dataset.load_prompts("eval-code", 3)


def test_arrivals():
    assert arrival_offsets(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    off = arrival_offsets(4000, 100.0, 1.0, 0)
    assert off == sorted(off) and off[0] == 0
    assert np.mean(np.diff(off)) == pytest.approx(0.01, rel=0.05)
    bursty = np.diff(arrival_offsets(4000, 100.0, 0.25, 0))
    assert np.std(bursty) > 1.5 * np.std(np.diff(off))  # gamma shape < 1: burstier than Poisson


def _req(send, chunks, out, prompt=10, per_chunk=None, ok=True):
    from adaspec.bench.client import RequestResult

    return RequestResult(success=ok, error="" if ok else "x", prompt_tokens=prompt, output_tokens=out,
                         send_time=send, chunk_times=list(chunks), chunk_tokens=per_chunk, end_time=chunks[-1] if chunks else send)


def test_compute_metrics_exact():
    from adaspec.bench.metrics import compute_metrics

    rs = [
        _req(0.0, [0.2, 0.3, 0.5], 7, per_chunk=[1, 4, 2]),  # TTFT 200, gaps 100/4 tok, 200/2 tok
        _req(0.1, [0.2, 0.6], 5),  # TTFT 100, one gap of 400 ms carrying 4 tokens (spread evenly)
        _req(0.0, [0.4], 1),  # one token: no TPOT, no per-user speed
        _req(0.0, [], 0, ok=False),
    ]
    m = compute_metrics(rs, duration=2.0)
    assert (m["completed"], m["failed"], m["total_output_tokens"], m["total_input_tokens"]) == (3, 1, 13, 30)
    assert m["output_throughput"] == 6.5 and m["request_throughput"] == 1.5 and m["total_token_throughput"] == 21.5
    assert m["mean_ttft_ms"] == pytest.approx(700 / 3) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 200)
    assert m["mean_itl_ms"] == pytest.approx(700 / 3) and m["median_itl_ms"] == pytest.approx(200)
    assert m["mean_e2el_ms"] == pytest.approx((500 + 500 + 400) / 3)
    # TPOT: 300/6 = 50 ms and 400/4 = 100 ms; per-user speed: 6/0.3 = 20 and 4/0.4 = 10 tok/s
    assert m["mean_tpot_ms"] == pytest.approx(75) and m["median_tpot_ms"] == pytest.approx(75)
    assert m["median_per_user_tok_s"] == pytest.approx(15) and m["p10_per_user_tok_s"] == pytest.approx(11)
    # token ITL samples: 25 ms x4, 100 ms x2, 100 ms x4 -> mean 700/10 = 70, median 100
    assert m["mean_itl_token_ms"] == pytest.approx(70)
    assert m["median_itl_token_ms"] == pytest.approx(100) and m["p10_per_user_tok_s"] < m["median_per_user_tok_s"]
    assert m["mean_tokens_per_chunk"] == pytest.approx(13 / 6)
    assert m["burst_delivered_requests"] == 0


def test_a_stream_flushed_in_one_burst_is_counted():
    """Per-user speed of a stream whose chunks were held back then flushed is the flush's (here
    63 tokens in 1 ms: 63,000 tok/s): the metrics count such streams so a report can say so."""
    from adaspec.bench.metrics import compute_metrics

    flushed = _req(0.0, [0.3 + i * 1e-4 for i in range(10)], 64)  # 10 chunks within 1 ms, after 300 ms
    steady = _req(0.0, [0.05 + i * 0.02 for i in range(10)], 64)
    two = _req(0.0, [0.3, 0.3001], 2)  # two chunks close together: not enough to call it a flush
    from adaspec.bench.metrics import burst_delivered

    m = compute_metrics([flushed, steady, two, _req(0.0, [], 0, ok=False)], duration=1.0)
    assert m["burst_delivered_requests"] == 1
    assert [burst_delivered(r) for r in (flushed, steady, two)] == [True, False, False]


def test_per_request_lists_place_each_send_in_time():
    from adaspec.bench.metrics import per_request_lists

    rs = [_req(10.0, [10.2, 10.3], 2), _req(10.5, [10.6], 1), _req(11.25, [], 0, ok=False)]
    lists = per_request_lists(rs, start=10.0)
    assert lists["send_offsets"] == [0.0, 0.5, 1.25]
    assert lists["ttfts"][:2] == pytest.approx([0.2, 0.1]) and lists["output_lens"] == [2, 1, 0]


def test_compute_metrics_nothing_completed():
    from adaspec.bench.metrics import compute_metrics

    m = compute_metrics([_req(0.0, [], 0, ok=False)], duration=0.5)
    assert m["completed"] == 0 and m["failed"] == 1 and m["output_throughput"] == 0
    assert m["median_ttft_ms"] is None and m["median_per_user_tok_s"] is None
