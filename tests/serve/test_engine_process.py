"""`adaspec serve --engine-process`: the engine in a spawned process of its own (serve/engine_process.py).
The HTTP behaviour on the real engine runs in both modes in test_real_engine.py; here what only
the process has: where the engine runs, a child that dies or cannot load, refusals that cross
the pipe, the metrics it reports, and a clean stop."""
from __future__ import annotations

import functools
import os
import signal
import time

import httpx
import pytest
from live_server import LiveServer, engine_pid, request_counts, stream_in_thread

pytest.importorskip("torch")
testing = pytest.importorskip("adaspec.testing")

ENGINE_ARGS = dict(max_num_seqs=16, num_kv_blocks=256, block_size=16, max_model_len=256, device="cpu")


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory):
    return str(testing.make_micro_model_dir(tmp_path_factory.mktemp("engine_process") / "micro"))


def _server(micro_dir, engine_args=None, **settings):
    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine

    config = EngineConfig(model=micro_dir, **{**ENGINE_ARGS, **(engine_args or {})})
    return LiveServer(functools.partial(build_engine, config), names=("micro",), engine_process=True, **settings)


@pytest.fixture(scope="module")
def server(micro_dir):
    s = _server(micro_dir)
    yield s
    s.close()


def test_the_engine_runs_in_another_process(server):
    pid = server.engine(engine_pid)
    assert pid != os.getpid() and pid == server.engine_thread._process.pid


def test_engine_refusals_cross_the_pipe_as_the_errors_the_thread_raises(server):
    """The HTTP side checks most of what add_request does; called directly, the engine's own
    refusal must come back as the InvalidRequestError (a 400 naming the field) it raised."""
    import asyncio

    from adaspec import SamplingParams
    from adaspec.errors import InvalidRequestError

    async def add():
        return await server.engine_thread.add("direct-1", [10, 99999], SamplingParams(max_tokens=2),
                                              time.monotonic(), 2)

    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        asyncio.run(add())
    assert e.value.param == "prompt"
    assert server.engine(request_counts) == (0, 0, False) and server.engine_thread.waiting_estimate() == 0


def test_metrics_come_from_the_engine_process(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "micro", "prompt": "def f(x):", "max_tokens": 5,
                                                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    text = httpx.get(server.url + "/metrics").text
    generated = [float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("adaspec:generation_tokens_total{")]
    assert generated and generated[0] >= 5
    assert 'adaspec:request_success_total{finished_reason="length",model_name="micro"}' in text


def test_a_killed_engine_process_fails_open_requests_and_ends_the_server(tmp_path):
    # the request must still be open when the kill lands: with 200 tokens a loaded CI machine once
    # let the engine finish them between the first chunk and the kill; 4,000 take it seconds more
    long_micro = str(testing.make_micro_model_dir(tmp_path / "micro", max_position_embeddings=4096))
    s = _server(long_micro, {"max_model_len": 4096, "num_kv_blocks": 260})
    died = []
    on_death = s.engine_thread.on_death  # the server's: exit non-zero
    s.engine_thread.on_death = lambda e: (died.append(e), on_death(e))
    try:
        thread, result, first = stream_in_thread(s.url + "/v1/completions",
                                                 {"model": "micro", "prompt": "x", "max_tokens": 4000, "ignore_eos": True})
        assert first.wait(60)
        os.kill(s.engine_thread._process.pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive()
        # the stream ends with an error event (its headers were sent), not a hang
        assert any('"engine_error"' in c for c in result["chunks"]), result
        deadline = time.monotonic() + 60  # a bound on a hang only
        while not died and time.monotonic() < deadline:
            time.sleep(0.01)
        assert died and "exit code -9" in str(died[0])
        # the server exits non-zero (uvicorn may already have closed its socket)
        assert not s.engine_thread.alive and s.server.exit_code == 1 and s.server.should_exit
    finally:
        s.close()


def test_requests_whose_clients_left_free_the_queue_for_new_ones(tmp_path):
    """Streams dropped by their clients are aborted in the engine without news to send back: the
    server must still learn the engine's new counts, or --max-queue (checked against them) refused
    every later request with 503 while the engine idled, and the gauges kept the old counts."""
    import json
    import socket

    long_micro = str(testing.make_micro_model_dir(tmp_path / "micro", max_position_embeddings=4096))
    s = _server(long_micro, {"max_model_len": 4096, "num_kv_blocks": 260, "max_num_seqs": 1}, max_queue=1)
    host, port = s.url.split("//")[1].split(":")
    socks = []

    def until(pred, what):
        deadline = time.monotonic() + 60  # a bound on a hang only
        while not pred() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pred(), what

    try:
        body = json.dumps({"model": "micro", "prompt": "x", "max_tokens": 4000, "ignore_eos": True,
                           "stream": True}).encode()
        for _ in range(2):  # one runs, one waits: the queue of 1 is full
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            socks.append(sock)
        until(lambda: s.engine_thread.waiting_estimate() == 1, "the second request waits")
        r = httpx.post(s.url + "/v1/completions", json={"model": "micro", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503
        for sock in socks:
            sock.close()
        until(lambda: s.engine(request_counts) == (0, 0, False), "both aborted in the engine")

        def gauges():
            return {line.split("{")[0]: float(line.split()[-1]) for line in httpx.get(s.url + "/metrics").text.splitlines()
                    if line.startswith(("adaspec:num_requests_running{", "adaspec:num_requests_waiting{"))}

        # before any new request (whose news would bring fresh counts anyway)
        until(lambda: s.engine_thread.waiting_estimate() == 0, "the server sees the queue empty")
        until(lambda: gauges() == {"adaspec:num_requests_running": 0.0, "adaspec:num_requests_waiting": 0.0},
              "the gauges follow the engine")
        r = httpx.post(s.url + "/v1/completions", json={"model": "micro", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
    finally:
        for sock in socks:
            sock.close()
        s.close()


def test_a_load_error_in_the_engine_process_is_raised_by_start(tmp_path):
    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine
    from adaspec.serve.engine_process import EngineProcess

    missing = tmp_path / "no-such-model"
    with pytest.raises(Exception, match="no-such-model"):
        EngineProcess(functools.partial(build_engine, EngineConfig(model=str(missing), device="cpu"))).start()


def test_stop_ends_the_process_and_fails_what_waits(micro_dir):
    s = _server(micro_dir)
    proc = s.engine_thread._process
    s.close()
    assert not proc.is_alive() and proc.exitcode == 0


def test_tensor_parallel_engine_in_its_own_process(micro_dir):
    """The engine process may start processes of its own (tensor-parallel workers, gloo on CPU):
    greedy text equals one process's, and stop() ends the workers with it."""
    from adaspec import LLM, SamplingParams
    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine

    want = LLM(micro_dir, **ENGINE_ARGS).generate(["x"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    s = LiveServer(functools.partial(build_engine, EngineConfig(model=micro_dir, tensor_parallel_size=2, **ENGINE_ARGS)),
                   names=("micro",), engine_process=True)
    proc = s.engine_thread._process
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": "micro", "prompt": "x", "max_tokens": 8,
                                                         "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    finally:
        s.close()
    # 0: it returned after stopping its workers (without that it outlives stop()'s wait and is killed)
    assert proc.exitcode == 0


def test_an_unpicklable_factory_is_a_clear_error():
    from adaspec.errors import ConfigError
    from adaspec.serve.engine_process import EngineProcess

    with pytest.raises(ConfigError, match="picklable engine factory"):
        EngineProcess(lambda: None).start()


def test_the_engine_process_logs_as_the_server_does(micro_dir, capfd):
    """Spawned, the child inherits none of the server's logging config: it sets the server's level
    and format itself, so the engine's INFO lines ("engine ready: ...") reach the server's log."""
    import logging

    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine
    from adaspec.serve.engine_process import EngineProcess

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        ep = EngineProcess(functools.partial(build_engine, EngineConfig(model=micro_dir, **ENGINE_ARGS))).start()
        ep.stop(timeout=30)
    finally:
        root.setLevel(level)
    err = capfd.readouterr().err
    assert "INFO adaspec.engine: engine ready" in err, err[-2000:]
