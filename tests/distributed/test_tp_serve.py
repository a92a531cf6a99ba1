"""`adaspec serve -tp 2` (CPU, gloo): SIGTERM drains as with one rank and stops the workers; a
worker killed mid-stream makes the server exit non-zero with the worker named in its log."""
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve"))
from adaspec.bench.server import free_port as _free_port  # noqa: E402
from live_server import start_server_process, stream_in_thread  # noqa: E402

pytestmark = pytest.mark.slow


def _serve(port: int) -> subprocess.Popen:
    return start_server_process([sys.executable, "-m", "adaspec.cli", "serve", "tiny", "-tp", "2", "--device", "cpu",
                                 "--port", str(port), "--num-kv-blocks", "64", "--max-model-len", "1024",
                                 "--drain-timeout", "30", "--log-level", "warning"], port, timeout=120)


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _stream(port: int, max_tokens: int):
    return stream_in_thread(f"http://127.0.0.1:{port}/v1/completions",
                            {"prompt": "def f(x):", "max_tokens": max_tokens, "ignore_eos": True})


def _stop(p):
    if p.poll() is None:
        p.kill()
        p.wait()


def test_sigterm_drains_then_stops_the_workers():
    port = _free_port()
    p = _serve(port)
    try:
        workers = _workers(p.pid)
        assert len(workers) == 1, workers
        # 64 tokens: the drain waits for the rest of the stream (200 took ~8 s of the test on 2 cores)
        t, result, first = _stream(port, 64)
        assert first.wait(60)
        p.send_signal(signal.SIGTERM)
        # read after the signal went out: the stream was still open when it did, so the drain is tested
        assert "[DONE]" not in list(result["chunks"]), result
        t.join(120)
        assert result["chunks"][-1] == "[DONE]" and '"finish_reason":"length"' in result["chunks"][-2], result
        assert p.wait(60) == 0, p.stdout.read()[-3000:]
        time.sleep(0.5)
        assert all(not os.path.exists(f"/proc/{w}") or open(f"/proc/{w}/stat").read().split()[2] == "Z"
                   for w in workers)
    finally:
        _stop(p)


def test_a_killed_worker_ends_the_server_nonzero():
    port = _free_port()
    p = _serve(port)
    try:
        (worker,) = _workers(p.pid)
        t, result, first = _stream(port, 800)
        assert first.wait(60)
        os.kill(worker, signal.SIGKILL)
        code = p.wait(60)
        out = p.stdout.read()
        t.join(60)
        assert code != 0, out[-3000:]
        assert "tensor-parallel worker rank 1" in out and "SIGKILL" in out, out[-3000:]
    finally:
        _stop(p)
