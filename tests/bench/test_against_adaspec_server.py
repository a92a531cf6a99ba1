"""`bench serve` against adaspec's own server (in process) with the serve tests' fake engine:
the SSE format, usage chunk and /metrics names the server really emits are what the client reads.
Skipped when the server or that fake engine is not there."""
import itertools
import os
import socket
import sys
import threading
import time

import pytest

from adaspec.bench.runner import BenchConfig, run_benchmark

SERVE_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve")


@pytest.fixture(scope="module")
def adaspec_server():
    server_mod = pytest.importorskip("adaspec.serve.server", reason="adaspec.serve is not built")
    state_mod = pytest.importorskip("adaspec.serve.state")
    sys.path.insert(0, SERVE_TESTS)
    try:
        fake_engine = pytest.importorskip("fake_engine", reason="tests/serve/fake_engine.py is not there")
    finally:
        sys.path.remove(SERVE_TESTS)
    settings = state_mod.ServerSettings(served_model_names=["fake"], max_queue=64)
    eng = server_mod.start_engine(
        lambda: fake_engine.FakeEngine(max_num_seqs=8, step_delay=0.002, tokens_per_step=3), settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = server_mod.make_server(eng, settings, port=sock.getsockname()[1], log_level="warning")
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 120  # a bound on a hang only (a loaded CI box starts slowly)
    while not srv.started:
        assert time.monotonic() < deadline and th.is_alive(), "server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    th.join(15)
    eng.stop()


def tick_clock(step: float = 0.001):
    """Every read is one step later: stamps are distinct and ordered however the chunks arrive
    (a loaded machine can deliver a whole stream in one read, which a real clock stamps alike)."""
    n = itertools.count(1)
    return lambda: next(n) * step


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_reads_adaspec_server(adaspec_server, endpoint):
    cfg = BenchConfig(base_url=adaspec_server, model="fake", prompts=[f"prompt {i}" for i in range(8)],
                      max_concurrency=4, output_len=12, ignore_eos=True, endpoint=endpoint,
                      num_warmups=2, progress=False, clock=tick_clock())
    res = run_benchmark(cfg)
    assert res["completed"] == 8 and res["failed"] == 0, res["errors"]
    assert res["usage_missing_requests"] == 0
    assert res["total_output_tokens"] == 8 * 12
    assert res["total_input_tokens"] > 0
    # three tokens per engine step leave as one chunk: tokens are counted from usage, not chunks
    assert res["mean_tokens_per_chunk"] > 1.5
    assert res["spec_num_drafts"] and res["spec_mean_accepted_length"] == pytest.approx(3.0)
    # the calibration counters the server exports: every draft accepted, each predicted at 0.8
    assert res["spec_verified_per_pos"] == res["spec_accepted_per_pos"]
    assert res["spec_calibration_ratio"] == pytest.approx(1 / 0.8)
    assert res["spec_calibration_ratio_per_pos"] == [pytest.approx(1 / 0.8)] * 2
    # the engine's steps during the run, from the counters the server really exports
    steps, secs = res["engine_steps"], res["engine_step_seconds"]
    assert steps >= 8 * 12 / 3 / 4 and secs > 0  # 3 tokens a step, at most 4 requests a step
    assert res["engine_output_tokens_per_step"] == pytest.approx(8 * 12 / steps)
    assert res["engine_mean_step_ms"] == pytest.approx(1000 * secs / steps)
    assert res["engine_busy_fraction"] == pytest.approx(secs / res["duration"])
    assert res["median_per_user_tok_s"] > 0 and res["p99_itl_ms"] >= res["median_itl_ms"]
