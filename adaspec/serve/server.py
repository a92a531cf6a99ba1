"""Run the app on uvicorn, with a SIGTERM drain.

uvicorn's own SIGTERM handling closes the listening socket at once (new clients get
"connection refused", not a 503) and re-raises the signal after shutdown, so the process does
not exit 0. ``DrainingServer`` instead, on the first SIGTERM/SIGINT: answers new requests with
503, lets running requests finish for ``drain_timeout`` seconds, aborts what is left, then lets
uvicorn shut down normally. A second signal forces the exit.
"""
from __future__ import annotations

import asyncio
import importlib.util
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import uvicorn

from adaspec.errors import AdaspecError, ConfigError
from adaspec.serve.app import build_app
from adaspec.serve.engine_thread import EngineThread
from adaspec.serve.metrics import ServerMetrics, use_multiprocess_dir
from adaspec.serve.state import LOG_FORMAT, ServerSettings, ServeState

log = logging.getLogger("adaspec.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServeState):
        super().__init__(config)
        self.serve_state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.exit_code = 0
        self.on_signal: Callable[[], None] | None = None  # the first server: forwards to the extra ones
        self.before_forced_exit: Callable[[], None] | None = None  # what a second signal's os._exit would skip
        state.engine_thread.on_death = self.engine_died

    def engine_died(self, error: BaseException) -> None:
        """Engine thread: the engine failed. Exit non-zero (as vLLM) instead of answering 503 forever."""
        log.error("the engine failed (%s: %s): the server exits", type(error).__name__, error)
        self.exit_code = 1
        self.serve_state.draining = True  # what still arrives gets 503 until the socket closes
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def api_server_exited(self, index: int, exitcode: int | None) -> None:
        """Watcher thread: an extra API server exited on its own. Drain the others and exit non-zero
        (a supervisor restarts the whole server)."""
        log.error("API server %d exited (exit code %s): the server drains and exits", index + 1, exitcode)
        self.exit_code = 1
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain_unless_draining)
        else:  # not serving yet: nothing to drain
            self.serve_state.draining = True
            self.should_exit = True

    def _drain_unless_draining(self) -> None:
        if not self.serve_state.draining:  # (a second signal would mean "exit now")
            self.handle_exit(signal.SIGTERM, None)

    def handle_exit(self, sig: int, frame) -> None:
        # Not calling super(): it records the signal to re-raise it after shutdown (exit != 0).
        if self.on_signal is not None:
            self.on_signal()
        if self._loop is None and not self.serve_state.draining:
            # before the event loop serves: nothing to drain, so a clean exit once it has started
            self.serve_state.draining = True
            self.should_exit = True
            return
        if self.serve_state.draining:
            # The second signal: leave now. Letting uvicorn cancel the running streams would print
            # a CancelledError traceback per stream; the client sees a closed connection either way.
            log.warning("signal %s while draining: exiting now", sig)
            if self.before_forced_exit is not None:
                self.before_forced_exit()
            logging.shutdown()
            sys.stderr.flush()
            os._exit(128 + sig)
        self.serve_state.draining = True
        log.info("signal %s: draining (no new requests; %.0fs for running ones)", sig,
                 self.serve_state.settings.drain_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        st = self.serve_state
        st.draining = True
        deadline = time.monotonic() + st.settings.drain_timeout
        while st.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if st.inflight > 0:
            log.warning("drain timeout: aborting %d running request(s)", st.inflight)
            st.engine_thread.abort_all("abort")
            deadline = time.monotonic() + 5.0
            while st.inflight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True


def make_server(engine_thread: EngineThread, settings: ServerSettings, host: str = "127.0.0.1",
                port: int = 8000, log_level: str = "info", access_log: bool = False) -> DrainingServer:
    state = ServeState(settings=settings, engine_thread=engine_thread)
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=5, lifespan="off")
    return DrainingServer(config, state)


def http_stack(config: uvicorn.Config) -> str:
    """Which event loop and HTTP parser uvicorn runs ("auto" takes uvloop and httptools when they are
    installed): benchmark logs must say, since the server's ceiling at many streams depends on it."""
    if not config.loaded:
        config.load()
    get_factory = getattr(config, "get_loop_factory", None)  # uvicorn >= 0.36
    if get_factory is not None:
        factory = get_factory()
        uses_uvloop = factory is not None and factory.__module__.startswith("uvloop")
    else:  # older: "auto" takes uvloop when it imports
        uses_uvloop = config.loop in ("auto", "uvloop") and importlib.util.find_spec("uvloop") is not None
    loop = "uvloop" if uses_uvloop else "asyncio"
    http = "httptools" if "httptools" in config.http_protocol_class.__module__ else "h11"
    return f"{loop} event loop, {http} HTTP"


def _http_stack_or_unknown(server) -> str:
    """http_stack for the start-up line: a uvicorn whose internals differ must not stop the server."""
    try:
        return http_stack(server.config)
    except Exception as e:  # noqa: BLE001 - a log line
        return f"event loop and HTTP parser unknown ({type(e).__name__})"


def start_engine(engine_factory: Callable[[], Any], settings: ServerSettings) -> EngineThread:
    """The engine in a thread of this process, or with settings.engine_process in a process of its
    own (engine_factory must then be picklable), with a pipe more for each extra API server."""
    name = settings.served_model_names[0]
    if settings.engine_process:
        from adaspec.serve.engine_process import EngineProcess

        return EngineProcess(engine_factory, lambda engine: ServerMetrics(name), settings.max_queue,
                             extra_api_servers=settings.api_server_count - 1,
                             api_detokenize=settings.api_detokenize).start()
    if settings.api_server_count > 1:
        raise ConfigError("--api-server-count above 1 needs the engine in a process of its own (--engine-process)")
    return EngineThread(engine_factory, lambda engine: ServerMetrics(name), settings.max_queue).start()


def _exiting_on_sigterm(start: Callable[[], Any]) -> Any:
    """start() with SIGTERM meaning a clean exit (0), not a kill: nothing to drain while the model
    loads or the extra API servers start."""
    if threading.current_thread() is not threading.main_thread():
        return start()

    def _exit(signum, frame):
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        return start()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signals_call(fn: Callable[[], None]) -> Callable[[], None]:
    """SIGINT and SIGTERM call fn() until the returned function puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, lambda signum, frame: fn()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) the server socket: done before the model loads, so a busy port or a
    bad address is a one-line error in a second, not after minutes of loading and profiling."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise AdaspecError(f"--port must be in [0, 65535], got {port}")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise AdaspecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def freeze_startup_objects() -> int:
    """Move every object alive now (the model, its CUDA graphs, the tokenizer, the app) into the
    garbage collector's permanent generation, as vLLM does after its engine starts. A process that
    imported torch tracks ~300k objects, and every full collection walks them all: ~220 ms on the
    2-core CPU box during which the engine stands still for every request in flight (one came
    within 200 steps at 256 streaming requests; frozen, a full collection takes ~0 ms:
    benchmarks/host_step_bench.py, BENCHMARKS.md). The young-generation collections of each step
    are not changed. The server holds one engine for its whole life, so nothing frozen is ever
    meant to be freed; objects made later are collected as usual. -> the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def set_switch_interval_from_env() -> float:
    """$ADASPEC_GIL_SWITCH_INTERVAL (seconds): the interpreter's GIL switch interval (default 5 ms).
    The engine thread releases the GIL in every torch call and may then wait up to one interval for
    the event loop's thread to hand it back (benchmarks/serve_gil_check.sh measures what that
    costs on a GPU). -> the interval in force."""
    value = os.environ.get("ADASPEC_GIL_SWITCH_INTERVAL")
    if value:
        try:
            interval = float(value)
            if not interval > 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"ADASPEC_GIL_SWITCH_INTERVAL must be a positive number of seconds, got {value!r}") from None
        sys.setswitchinterval(interval)
    return sys.getswitchinterval()


def run(engine_factory: Callable[[], Any], settings: ServerSettings, host: str, port: int,
        log_level: str = "info", access_log: bool = True) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, and return the exit status: 0, or 1
    when the engine (or an extra API server) failed (a supervisor then restarts the server)."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT)
    set_switch_interval_from_env()
    sock = bind_socket(host, port)
    # a scrape may land on any of the API servers: then the metrics live in files they share
    metrics_dir = tempfile.mkdtemp(prefix="adaspec-metrics-") if settings.api_server_count > 1 else None
    restore_metrics = use_multiprocess_dir(metrics_dir)
    extra = None
    try:
        et = _exiting_on_sigterm(lambda: start_engine(engine_factory, settings))
    except BaseException:
        sock.close()
        restore_metrics()
        _remove(metrics_dir)
        raise
    try:
        server = make_server(et, settings, host, port, log_level, access_log)
        server.before_forced_exit = lambda: _remove(metrics_dir)
        if settings.api_server_count > 1:
            from adaspec.serve.api_servers import ApiServers

            extra = ApiServers(et.client_conns, sock, settings, host, port, log_level, access_log)
            _exiting_on_sigterm(extra.start)  # N interpreters start: a SIGTERM meanwhile is a clean exit
            server.on_signal = extra.drain
            extra.watch(server.api_server_exited)
        freeze_startup_objects()
        log.info("adaspec serving %s on http://%s:%d (engine in %s; %s%s)", settings.served_model_names[0], host,
                 sock.getsockname()[1], "a process of its own" if settings.engine_process else "a thread",
                 _http_stack_or_unknown(server),
                 f"; {settings.api_server_count} API server processes" if settings.api_server_count > 1 else "")
        server.run(sockets=[sock])
    finally:
        if extra is not None:
            # uvicorn has put the default handlers back: a signal while the extra servers finish
            # their streams tells them to exit now (a second drain signal), as it would the first
            restore_signals = _signals_call(extra.drain)
            try:
                if any(code not in (0, None) for code in extra.stop(settings.drain_timeout + 10)):
                    server.exit_code = 1
            finally:
                restore_signals()
        et.stop()
        sock.close()
        restore_metrics()
        _remove(metrics_dir)
    return server.exit_code


def _remove(path: str | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
