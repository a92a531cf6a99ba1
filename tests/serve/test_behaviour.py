"""Server behaviour that the fake engine shows fastest: a busy engine, client disconnects, metrics."""
from __future__ import annotations

import threading
import time

import httpx
from live_server import LiveServer, openai_client
from fake_engine import FakeEngine
from prometheus_client.parser import text_string_to_metric_families


def _metrics(url) -> dict[tuple, float]:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_health_and_new_requests_answered_while_engine_steps():
    s = LiveServer(lambda: FakeEngine(step_delay=1.0), names=("fake",))
    try:
        t = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                                       timeout=30))
        t.start()
        deadline = time.monotonic() + 5
        while not s.engine_thread.metrics or s.state.inflight == 0:  # the request is in the engine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):  # each answered well within one 1 s engine step
            t0 = time.monotonic()
            assert httpx.get(s.url + "/health").status_code == 200
            assert httpx.get(s.url + "/v1/models").status_code == 200
            assert time.monotonic() - t0 < 0.5
        t.join()
    finally:
        s.close()


def test_non_streaming_client_disconnect_aborts_request():
    s = LiveServer(lambda: FakeEngine(step_delay=0.01, max_model_len=4096), names=("fake",))
    try:
        try:  # 1000 tokens at 10 ms/step would take 10 s; the client gives up after 0.3 s
            httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000}, timeout=0.3)
        except httpx.TimeoutException:
            pass
        deadline = time.monotonic() + 3
        while s.engine(lambda e: e.has_unfinished_requests()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not s.engine(lambda e: e.has_unfinished_requests())
        assert s.engine(lambda e: e.kv_blocks_free() == e.kv_blocks_total())
        m = _metrics(s.url)
        assert m[("adaspec:request_success_total", (("finished_reason", "abort"),))] == 1
    finally:
        s.close()


def test_streaming_client_disconnect_aborts_request():
    s = LiveServer(lambda: FakeEngine(step_delay=0.01, max_model_len=4096), names=("fake",))
    try:
        body = {"prompt": "x", "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            next(r.iter_lines())
        free, total = s.wait_idle(timeout=3)
        assert free == total and s.state.inflight == 0
    finally:
        s.close()


def test_metrics_parse_and_move():
    s = LiveServer(lambda: FakeEngine(tokens_per_step=3), names=("fake",))
    try:
        before = _metrics(s.url)
        c = openai_client(s)
        c.completions.create(model="fake", prompt="hello", max_tokens=10)
        list(c.completions.create(model="fake", prompt="hello", max_tokens=7, stream=True))
        httpx.post(s.url + "/v1/completions", json={"prompt": "x", "n": 0})
        s.wait_idle()
        m = _metrics(s.url)
        assert before.get(("adaspec:request_success_total", (("finished_reason", "length"),)), 0) == 0
        assert m[("adaspec:request_success_total", (("finished_reason", "length"),))] == 2
        assert m[("adaspec:request_errors_total", (("status", "400"),))] == 1
        assert m[("adaspec:generation_tokens_total", ())] == 17
        assert m[("adaspec:prompt_tokens_total", ())] == 10
        assert m[("adaspec:time_to_first_token_seconds_count", ())] == 2
        assert m[("adaspec:inter_token_latency_seconds_count", ())] == 3 + 2  # chunks after the first
        assert m[("adaspec:e2e_request_latency_seconds_count", ())] == 2
        assert m[("adaspec:num_requests_running", ())] == 0
        assert m[("adaspec:num_requests_waiting", ())] == 0
        assert m[("adaspec:kv_cache_usage_perc", ())] == 0
        # speculation: 5 decode steps with k=2 drafts accepted fully
        assert m[("adaspec:spec_decode_num_drafts_total", ())] == 5
        assert m[("adaspec:spec_decode_mixed_steps_fused_total", ())] == 0  # not the fused mode
        assert m[("adaspec:spec_decode_num_draft_tokens_total", ())] == 10
        assert m[("adaspec:spec_decode_num_accepted_tokens_total", ())] == 10
        assert m[("adaspec:spec_decode_num_verified_tokens_total", ())] == 15
        assert m[("adaspec:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == 5
        assert m[("adaspec:spec_decode_num_accepted_tokens_per_pos_total", (("position", "1"),))] == 5
        steps = m[("adaspec:spec_decode_budget_steps_total", (("budget", "2"),))]
        assert steps > 0 and m[("adaspec:spec_decode_budget_count", ())] == steps
        assert m[("adaspec:spec_decode_budget_sum", ())] == 2 * steps
    finally:
        s.close()


def test_kv_usage_gauge_while_running():
    s = LiveServer(lambda: FakeEngine(step_delay=0.05), names=("fake",))
    try:
        t = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 40},
                                                       timeout=30))
        t.start()
        deadline = time.monotonic() + 5
        while _metrics(s.url)[("adaspec:num_requests_running", ())] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _metrics(s.url)[("adaspec:kv_cache_usage_perc", ())] > 0
        t.join()
        assert _metrics(s.url)[("adaspec:kv_cache_usage_perc", ())] == 0
    finally:
        s.close()
