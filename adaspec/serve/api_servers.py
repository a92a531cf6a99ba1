"""More API server processes on one engine (`adaspec serve --api-server-count N`), as vLLM's.

At many streams one HTTP process is the bound, not the engine: on the H200 at 256 streams the
server made 0.6-0.75x the offline engine's tokens per second (BENCHMARKS.md, run 21), one core
busy parsing requests, formatting SSE chunks and publishing the engine's batches. Here the first
process (the one `adaspec serve` started) owns the engine process and serves as before, and N - 1
more processes serve the same listening socket (the kernel hands each connection to one of them),
each with a pipe of its own to the engine process (engine_process.EngineClient).

Signals: a terminal's Ctrl-C and a group-wide SIGTERM reach every process, and a forwarded one
would then count as a second signal (an immediate exit), so the extra servers ignore SIGINT and
SIGTERM and drain on SIGUSR1, which the first sends them when it starts to drain (and again on a
second signal, to exit now). An extra server that exits on its own (its engine link failed, it
was killed) ends the whole server non-zero, as a failed engine does.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from typing import Callable

from adaspec.serve.state import LOG_FORMAT, ServerSettings

log = logging.getLogger("adaspec.serve")

DRAIN_SIGNAL = signal.SIGUSR1


def api_server_main(index: int, conn, sock, settings: ServerSettings, host: str, port: int, log_level: str,
                    access_log: bool, ready) -> None:
    """An extra API server process: serve ``sock`` on the engine behind ``conn`` until told to
    drain; ``ready`` (an Event) is set once it is about to serve."""
    # before anything slow: the first server signals only servers that are ready, but a group-wide
    # signal may come at any time (the drain is the first server's to start)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from adaspec.serve.engine_process import EngineClient
    from adaspec.serve.metrics import ServerMetrics
    from adaspec.serve.server import DrainingServer, freeze_startup_objects, make_server

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT)
    name = settings.served_model_names[0]
    client = EngineClient(conn, lambda engine: ServerMetrics(name, engine_counters=False),
                          settings.max_queue, api_detokenize=settings.api_detokenize).start()
    server = make_server(client, settings, host, port, log_level, access_log)

    def handle_exit(sig: int, frame) -> None:
        if sig == DRAIN_SIGNAL:
            DrainingServer.handle_exit(server, sig, frame)
        # SIGINT / SIGTERM: the first server forwards them as DRAIN_SIGNAL (see the module's docstring)

    server.handle_exit = handle_exit  # what uvicorn installs for SIGINT and SIGTERM
    signal.signal(DRAIN_SIGNAL, handle_exit)
    freeze_startup_objects()
    log.info("API server %d of %d ready (pid %d)", index + 1, settings.api_server_count, os.getpid())
    ready.set()
    try:
        server.run(sockets=[sock])
    finally:
        client.stop(timeout=5.0)
    sys.exit(server.exit_code)


class ApiServers:
    """The extra API server processes, seen from the first."""

    def __init__(self, conns: list, sock, settings: ServerSettings, host: str, port: int, log_level: str,
                 access_log: bool):
        ctx = multiprocessing.get_context("spawn")
        self._conns = conns
        self._ready = [ctx.Event() for _ in conns]
        self.processes = [ctx.Process(target=api_server_main, name=f"adaspec-api-server-{i + 2}",
                                      args=(i + 1, conn, sock, settings, host, port, log_level, access_log, ready))
                          for i, (conn, ready) in enumerate(zip(conns, self._ready))]
        self._stopping = False
        self._watcher: threading.Thread | None = None
        self._drains = 0  # drain signals sent: the second means "exit now"

    def start(self, timeout: float = 300.0) -> "ApiServers":
        """Start them and wait until each is about to serve (so that a drain signal finds its
        handler in place): raises RuntimeError if one exits first or ``timeout`` s pass."""
        try:
            for p, conn in zip(self.processes, self._conns):
                p.start()
                # ours would keep the pipe open after that server dies: the engine would see no end of
                # it, keep running its requests, and block sending to it once the pipe filled up
                conn.close()
            deadline = time.monotonic() + timeout
            for p, ready in zip(self.processes, self._ready):
                while not ready.wait(0.05):
                    if not p.is_alive():
                        raise RuntimeError(f"{p.name} exited while starting (exit code {p.exitcode})")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{p.name} did not start within {timeout:.0f} s")
        except BaseException:  # a failed start, or SIGTERM meanwhile (server.run: a clean exit)
            self._stopping = True
            for p in self.processes:
                if p.pid is not None:
                    p.kill()
                    p.join(5)
            raise
        return self

    def drain(self) -> None:
        """Tell every extra server to drain (a second call: to exit now)."""
        self._drains += 1
        for p in self.processes:
            if p.is_alive():
                try:
                    os.kill(p.pid, DRAIN_SIGNAL)
                except ProcessLookupError:
                    pass

    def watch(self, on_exit: Callable[[int, int], None]) -> None:
        """Call ``on_exit(index, exitcode)`` (in a thread) when an extra server exits before it was
        told to drain (or stop())."""

        def wait() -> None:
            left = {p.sentinel: p for p in self.processes}
            while left and not self._stopping:
                for sentinel in multiprocessing.connection.wait(list(left), timeout=1.0):
                    p = left.pop(sentinel)
                    p.join()
                    if not self._stopping and self._drains == 0:
                        on_exit(self.processes.index(p) + 1, p.exitcode)  # index 0 is the first server

        self._watcher = threading.Thread(target=wait, name="adaspec-api-servers-watch", daemon=True)
        self._watcher.start()

    def stop(self, timeout: float) -> list[int | None]:
        """Drain the servers (unless they are draining already: a second signal would cut their
        streams), wait ``timeout`` s, kill what is left. -> their exit codes."""
        self._stopping = True
        if self._watcher is not None:
            # one thread reaps them: a second one's waitpid would find a child already reaped by the
            # first and take it for alive, its exit status lost
            self._watcher.join(5)
        if self._drains == 0:
            self.drain()
        deadline = time.monotonic() + timeout  # one wait for all of them: they drain together
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                log.warning("API server %s did not stop within %.0fs: killing it", p.name, timeout)
                p.kill()
                p.join(5)
        return [p.exitcode for p in self.processes]
