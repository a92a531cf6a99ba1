"""Live servers for the serve tests: uvicorn in a background thread on a free loopback port.
A module of its own (not conftest.py): several test folders have a conftest.py, and which one
`import conftest` finds depends on collection order."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

from adaspec.serve.server import make_server, start_engine
from adaspec.serve.state import ServerSettings


class LiveServer:
    """An in-process server; ``engine_thread.call(fn)`` inspects the engine on its own thread."""

    def __init__(self, engine_factory, names=("fake",), start_timeout: float = 120.0, **settings):
        self.settings = ServerSettings(served_model_names=list(names), **settings)
        self.engine_thread = start_engine(engine_factory, self.settings)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.engine_thread, self.settings, port=self.port, log_level="warning")
        self.state = self.server.serve_state
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout  # a bound on a hang only (a loaded CI box starts slowly)
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def engine(self, fn):
        """fn(engine) on the engine's thread, or in its process (fn must then be picklable: a
        module-level function such as the ones below)."""
        return self.engine_thread.call(fn)

    def wait_idle(self, timeout=10.0):
        """Wait until the engine has nothing running or waiting; return (free, total) KV blocks."""
        deadline = time.monotonic() + timeout
        while True:
            busy, free, total = self.engine(idle_state)
            if (not busy and self.state.inflight == 0) or time.monotonic() > deadline:
                return free, total
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self._thread.join(15)
        self.engine_thread.stop()


def idle_state(engine):
    return engine.has_unfinished_requests(), engine.kv_blocks_free(), engine.kv_blocks_total()


def request_counts(engine):
    return engine.num_running(), engine.num_waiting(), engine.has_unfinished_requests()


def openai_client(server: LiveServer, key: str = "none"):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def stream_in_thread(url: str, body: dict, timeout: float = 120):
    """Start a streaming completion in a thread; returns (thread, result dict with "chunks",
    "status" and any "error", event set after the first chunk or at the end)."""
    import httpx

    result: dict = {"chunks": []}
    first = threading.Event()

    def go():
        try:
            with httpx.stream("POST", url, json=dict(body, stream=True), timeout=timeout) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        result["chunks"].append(line[6:])
                        first.set()
        except Exception as e:  # noqa: BLE001 - reported by the assertions
            result["error"] = repr(e)
        first.set()

    t = threading.Thread(target=go)
    t.start()
    return t, result, first


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server_process(cmd: list[str], port: int, timeout: float = 60, new_group: bool = False) -> subprocess.Popen:
    """Start a server command (repo root on PYTHONPATH) and wait until its /health answers 200.
    Raises AssertionError with its output if it exits first, or after `timeout` seconds.
    new_group: in a process group of its own (so a test can signal the whole group, as systemd does)."""
    import httpx

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=new_group)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise AssertionError(f"server exited with {p.returncode}: {p.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return p
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    p.kill()
    raise AssertionError(f"server did not come up within {timeout} s")


def engine_pid(engine):
    return os.getpid()
