"""Run the app on uvicorn, with a SIGTERM drain.

uvicorn's own SIGTERM handling closes the listening socket at once (new clients get
"connection refused", not a 503) and re-raises the signal after shutdown, so the process does
not exit 0. ``DrainingServer`` instead, on the first SIGTERM/SIGINT: answers new requests with
503, lets running requests finish for ``drain_timeout`` seconds, aborts what is left, then lets
uvicorn shut down normally. A second signal forces the exit.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from typing import Any, Callable

import uvicorn

from adaspec.errors import AdaspecError
from adaspec.serve.app import build_app
from adaspec.serve.engine_thread import EngineThread
from adaspec.serve.metrics import ServerMetrics
from adaspec.serve.state import ServerSettings, ServeState

log = logging.getLogger("adaspec.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServeState):
        super().__init__(config)
        self.serve_state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Not calling super(): it records the signal to re-raise it after shutdown (exit != 0).
        if self.serve_state.draining or self._loop is None:
            self.force_exit = True
            self.should_exit = True
            return
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


def start_engine(engine_factory: Callable[[], Any], settings: ServerSettings) -> EngineThread:
    name = settings.served_model_names[0]
    return EngineThread(engine_factory, lambda engine: ServerMetrics(name), settings.max_queue).start()


def _load_exiting_on_sigterm(engine_factory: Callable[[], Any], settings: ServerSettings) -> EngineThread:
    # Nothing to drain while the model loads: a SIGTERM then is a clean exit (0), not a kill.
    if threading.current_thread() is not threading.main_thread():
        return start_engine(engine_factory, settings)

    def _exit(signum, frame):
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        return start_engine(engine_factory, settings)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(engine_factory: Callable[[], Any], settings: ServerSettings, host: str, port: int,
        log_level: str = "info", access_log: bool = True) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, and return the exit status (0)."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    et = _load_exiting_on_sigterm(engine_factory, settings)
    try:
        server = make_server(et, settings, host, port, log_level, access_log)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise AdaspecError(f"cannot listen on {host}:{port}: {e}") from None
        log.info("adaspec serving %s on http://%s:%d", settings.served_model_names[0], host,
                 sock.getsockname()[1])
        server.run(sockets=[sock])
    finally:
        et.stop()
    return 0

