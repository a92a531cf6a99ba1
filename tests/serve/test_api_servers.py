"""`adaspec serve --api-server-count N` (serve/api_servers.py): N HTTP server processes on one
engine process, each with a pipe of its own to it.

The engine's loop over several pipes runs here in a thread with the fake engine (as in
test_engine_process_batches.py); the whole server runs as a process (fake_api_servers_proc.py)."""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from adaspec.bench.server import free_port
from adaspec.sampling_params import SamplingParams
from adaspec.serve.engine_process import serve_engine
from fake_engine import FakeEngine, FakeTokenizer, expected_text
from live_server import start_server_process

HERE = os.path.dirname(os.path.abspath(__file__))


# -------------------------------------------------------------------- the engine's loop, two pipes
def _requests(engine):
    return sorted(r.rid for r in engine.waiting + engine.running)


class _TwoServers:
    def __init__(self, **engine_kw):
        pairs = [multiprocessing.Pipe(duplex=True) for _ in range(2)]
        self.conns = [ours for ours, _ in pairs]
        self.engine = FakeEngine(**engine_kw)
        self.thread = threading.Thread(target=serve_engine, args=(self.engine, [c for _, c in pairs]), daemon=True)
        self.thread.start()

    def recv(self, i: int, timeout: float = 30):
        assert self.conns[i].poll(timeout), f"the engine loop sent nothing to server {i}"
        return self.conns[i].recv()

    def acks(self, i: int) -> list:
        """Server i's next acknowledgements (the step snapshots every server gets meanwhile, with no
        news of its own, are asked past)."""
        while True:
            kind, acks, records, _ = self.recv(i)
            assert kind == "batch"
            if acks:
                return acks
            self.conns[i].send(("more",))

    def call(self, i: int, fn):
        self.conns[i].send(("call", 0, fn))
        while True:
            msg = self.recv(i)
            if msg[0] == "call":
                assert msg[2], msg[3]
                return msg[3]
            if msg[0] == "batch":
                self.conns[i].send(("more",))

    def collect(self, i: int) -> dict[str, list]:
        """Server i's news until its requests have finished: request id -> (token ids, finish)."""
        got: dict[str, list] = {}
        done: dict[str, str] = {}
        while True:
            kind, acks, records, _ = self.recv(i)
            assert kind == "batch"
            for rid, ids, _, _, _, _, finish, _, _, _ in records:
                got.setdefault(rid, []).extend(ids)
                if finish is not None:
                    done[rid] = finish
            if got and set(done) == set(got):
                return {rid: (got[rid], done[rid]) for rid in got}
            self.conns[i].send(("more",))

    def stop(self):
        self.conns[0].send(("stop",))
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_each_request_news_goes_back_through_the_pipe_that_added_it():
    two = _TwoServers(max_num_seqs=8, max_model_len=64)
    tok = FakeTokenizer()
    try:
        two.conns[0].send(("add", "a", tok.encode("aa"), SamplingParams(max_tokens=9), 0.0))
        two.conns[1].send(("add", "b", tok.encode("b"), SamplingParams(max_tokens=13), 0.0))
        got_a, got_b = two.collect(0), two.collect(1)
        assert got_a == {"a": ([ord(c) for c in expected_text(tok.encode("aa"), 9)], "length")}
        assert got_b == {"b": ([ord(c) for c in expected_text(tok.encode("b"), 13)], "length")}
    finally:
        two.stop()


def test_a_server_aborts_only_its_own_requests():
    two = _TwoServers(max_num_seqs=8, max_model_len=4096)
    tok = FakeTokenizer()
    try:
        two.conns[0].send(("add", "a", tok.encode("a"), SamplingParams(max_tokens=2000), 0.0))
        two.conns[1].send(("add", "b", tok.encode("b"), SamplingParams(max_tokens=2000), 0.0))
        assert two.acks(0) == [("a", None)] and two.acks(1) == [("b", None)]
        two.conns[1].send(("abort", "a"))  # not server 1's: ignored
        two.conns[1].send(("abort_all",))  # server 1's requests only
        assert two.call(1, _requests) == ["a"]
        two.conns[0].send(("abort_all",))
        assert two.call(0, _requests) == []
    finally:
        two.stop()


@pytest.mark.parametrize("adder, watcher", [(1, 0), (0, 1)])
def test_every_server_sees_every_step_s_snapshot_even_without_requests_of_its_own(adder, watcher):
    # the first adds the engine's counters to /metrics (metrics.py) and each checks --max-queue
    # against the engine's waiting count: a server's snapshots must not stop at its own requests'
    # last news, or the counters would lag and an idle server could refuse requests for good
    two = _TwoServers(max_num_seqs=8, max_model_len=64)
    try:
        two.conns[adder].send(("add", "r", FakeTokenizer().encode("b"), SamplingParams(max_tokens=11), 0.0))
        assert two.collect(adder)["r"][1] == "length"
        while True:
            kind, acks, records, snapshot = two.recv(watcher, timeout=10)
            assert kind == "batch" and acks == [] and records == []
            if snapshot.stats.num_generated_tokens == 11:
                break
            two.conns[watcher].send(("more",))
        assert snapshot.waiting == 0 and snapshot.running == 0
    finally:
        two.stop()


@pytest.mark.parametrize("how", ["bye", "closed"])
def test_a_server_that_leaves_takes_its_requests_along_and_the_engine_serves_on(how):
    # 5 ms steps: the left request would run 10 s, far beyond the wait below, unless aborted
    two = _TwoServers(max_num_seqs=8, max_model_len=4096, step_delay=0.005)
    tok = FakeTokenizer()
    try:
        two.conns[1].send(("add", "b", tok.encode("b"), SamplingParams(max_tokens=2000), 0.0))
        assert two.acks(1) == [("b", None)]
        if how == "bye":  # EngineClient.stop(): the child closes its end, the reader sees the end
            two.conns[1].send(("bye",))
            with pytest.raises(EOFError):
                while True:
                    two.recv(1)
        two.conns[1].close()
        for _ in range(200):
            if two.call(0, _requests) == []:
                break
            time.sleep(0.01)
        assert two.call(0, _requests) == []
        two.conns[0].send(("add", "a", tok.encode("a"), SamplingParams(max_tokens=5), 0.0))
        assert two.collect(0) == {"a": ([ord(c) for c in expected_text(tok.encode("a"), 5)], "length")}
    finally:
        two.stop()


# -------------------------------------------------------------------- the whole server, 2 API servers
def _sockets_by_pid(port: int, established_only: bool) -> dict[int, int]:
    """TCP sockets on the server's port (only the established connections, or the listening
    one too), by the pid holding them (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and (f[3] == "01" or not established_only):
                inodes.add(f[9])
    counts: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            continue
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed since the listing (a busy server opens and closes fds all the time)
                continue
        n = sum(1 for link in links if link.startswith("socket:[") and link[8:-1] in inodes)
        if n:
            counts[int(pid)] = n
    return counts


def _metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(f"adaspec:{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


def _stream(base: str, prompt: str, max_tokens: int) -> str:
    text = ""
    with httpx.stream("POST", base + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@contextlib.contextmanager
def _two_api_servers(drain: float = 30.0, new_group: bool = False):
    """The whole server, 2 API server processes on the fake engine (10 ms steps), in a process of
    its own: (process, port); killed at the end if it still runs."""
    port = free_port()
    p = start_server_process([sys.executable, os.path.join(HERE, "fake_api_servers_proc.py"), str(port), "2", "0.01",
                              str(drain)], port, timeout=120, new_group=new_group)
    try:
        yield p, port
    finally:
        if p.poll() is None:
            if new_group:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                p.kill()
            p.wait()


def _streams_until(port: int, enough, max_tokens: int, prefix: str) -> list:
    """Open streaming completions one at a time (each past its first chunk) until
    ``enough(connections by pid)``; at most 24. -> [(thread, result)] (live_server.stream_in_thread)."""
    from live_server import stream_in_thread

    streams = []
    for i in range(24):
        t, result, first = stream_in_thread(f"http://127.0.0.1:{port}/v1/completions",
                                            {"prompt": f"{prefix}{i}", "max_tokens": max_tokens, "ignore_eos": True})
        assert first.wait(30), result
        streams.append((t, result))
        if enough(_sockets_by_pid(port, True)):
            break
    assert enough(_sockets_by_pid(port, True))
    return streams


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_api_servers_share_the_load_one_engine_and_one_set_of_metrics():
    n, max_tokens = 48, 40
    with _two_api_servers() as (p, port):
        base = f"http://127.0.0.1:{port}"
        holders: set[int] = set()
        stop = threading.Event()

        def watch():  # who holds the client connections while they stream
            while not stop.is_set():
                holders.update(pid for pid in _sockets_by_pid(port, True) if pid != os.getpid())
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        tok = FakeTokenizer()
        batches = 0
        while batches < 3:  # the kernel may hand one wave's connections all to one process: another wave
            prompts = [f"p{batches}-{i}" for i in range(n)]
            with ThreadPoolExecutor(n) as pool:
                texts = list(pool.map(lambda s: _stream(base, s, max_tokens), prompts))
            batches += 1
            assert texts == [expected_text(tok.encode(s), max_tokens) for s in prompts]
            if len(holders) == 2:
                break
        stop.set()
        watcher.join()
        # the client's own sockets are in this process; the server's ends in the two HTTP processes
        # (the first and its child), not in the engine process
        assert p.pid in holders and len(holders) == 2, holders
        # one scrape, whichever process answers, counts every request once, and the engine's tokens
        # once (the first server adds them from the last step's snapshot, which may come a moment
        # after the last stream ended: wait for it; counted twice would never match)
        deadline = time.monotonic() + 30
        while True:
            m = httpx.get(base + "/metrics", timeout=10).text
            done = _metric(m, "generation_tokens_total") == batches * n * max_tokens
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for _ in range(4):
            m = httpx.get(base + "/metrics", timeout=10).text
            assert _metric(m, "request_success_total", 'finished_reason="length"') == batches * n
            assert _metric(m, "generation_tokens_total") == batches * n * max_tokens
            assert _metric(m, "num_requests_running") == 0
            # the engine's time in steps crosses from the engine process too (bench serve reads it)
            assert _metric(m, "engine_step_seconds_total") > 0 and _metric(m, "engine_steps_total") > 0
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, p.stdout.read()[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_api_server_that_dies_ends_the_server_non_zero():
    with _two_api_servers() as (p, port):
        servers = set(_sockets_by_pid(port, False))  # the listening socket: the two HTTP processes
        assert p.pid in servers and len(servers) == 2, servers
        os.kill((servers - {p.pid}).pop(), signal.SIGKILL)
        assert p.wait(60) == 1, p.stdout.read()[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_engine_drops_the_requests_of_an_api_server_that_died():
    # the first server must not keep the extra servers' pipe ends open: the engine would see no
    # end of a dead server's pipe, run its requests on, and block once that pipe filled up
    with _two_api_servers(drain=60) as (p, port):
        extra = (set(_sockets_by_pid(port, False)) - {p.pid}).pop()
        # 3000 tokens at 10 ms a step: they would run 30 s
        streams = _streams_until(port, lambda held: held.get(extra) and held.get(p.pid), 3000, "x")
        own = _sockets_by_pid(port, True)[p.pid]
        os.kill(extra, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:  # the first server drains its own streams meanwhile, and answers /metrics while it does
            running = _metric(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, "num_requests_running")
            if running == own or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert running == own, f"{running} running, {own} of them the first server's"
    for t, _ in streams:
        t.join(30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigterm_to_the_whole_group_drains_every_api_server_and_exits_0():
    # systemd, `timeout` and `kill -TERM -PGID` signal every process: the extra servers must leave
    # the drain to the first (which forwards it once), or the forwarded signal would be their second
    # and cut their streams
    with _two_api_servers(drain=60, new_group=True) as (p, port):
        servers = set(_sockets_by_pid(port, False))
        # until both servers hold a stream; 400 tokens at 10 ms: ~4 s each
        streams = _streams_until(port, lambda held: all(held.get(pid) for pid in servers), 400, "g")
        os.killpg(p.pid, signal.SIGTERM)
        for t, result in streams:
            t.join(60)
            assert result.get("status") == 200 and "error" not in result, result
            assert result["chunks"][-1] == "[DONE]"
            last = [json.loads(c) for c in result["chunks"][:-1] if json.loads(c).get("choices")][-1]
            assert last["choices"][0]["finish_reason"] == "length"
        assert p.wait(60) == 0, p.stdout.read()[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_signal_exits_at_once_and_leaves_no_metrics_files_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the server makes its metrics directory
    with _two_api_servers(drain=60) as (p, port):
        assert [n for n in os.listdir(tmp_path) if n.startswith("adaspec-metrics-")]
        # until the first server holds a stream (30 s each: its drain waits on it)
        streams = _streams_until(port, lambda held: held.get(p.pid), 3000, "x")
        p.send_signal(signal.SIGTERM)  # a drain of 60 s
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 128 + signal.SIGTERM, p.stdout.read()[-3000:]
        assert not [n for n in os.listdir(tmp_path) if n.startswith("adaspec-metrics-")]
    for t, _ in streams:
        t.join(30)


def _open_stream(port: int, prompt: str, max_tokens: int):
    """A streaming completion left open after its first chunk: (connection, response)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                                              "ignore_eos": True, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return conn, resp


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_signal_while_only_the_other_servers_stream_ends_them_and_says_so():
    # the first has drained (nothing of its own) and waits for the others: a second signal then
    # tells them to exit now, and their forced exit makes the status 1 (their exit codes must not
    # be lost between the thread that watches them and the one that stops them)
    opened = []
    with _two_api_servers(drain=60) as (p, port):
        extra = (set(_sockets_by_pid(port, False)) - {p.pid}).pop()
        for i in range(24):  # a stream on the other server; any that lands on the first is closed again
            before = _sockets_by_pid(port, True).get(p.pid, 0)
            conn, _ = _open_stream(port, f"y{i}", 3000)
            if _sockets_by_pid(port, True).get(p.pid, 0) > before:
                conn.close()  # the first server aborts it at its next chunk
                continue
            opened.append(conn)
            break
        assert opened and _sockets_by_pid(port, True).get(extra)
        deadline = time.monotonic() + 10
        while _sockets_by_pid(port, True).get(p.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _sockets_by_pid(port, True).get(p.pid)
        p.send_signal(signal.SIGTERM)  # the first drains at once; the other's stream would run 30 s
        time.sleep(0.5)
        assert p.poll() is None  # waiting for the other server
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 1, p.stdout.read()[-3000:]
    for conn in opened:
        conn.close()


def test_more_than_one_api_server_without_the_engine_process_is_a_clear_error():
    from adaspec.errors import ConfigError
    from adaspec.serve.server import start_engine
    from adaspec.serve.state import ServerSettings

    with pytest.raises(ConfigError, match="needs the engine in a process of its own"):
        start_engine(FakeEngine, ServerSettings(served_model_names=["fake"], api_server_count=2))
