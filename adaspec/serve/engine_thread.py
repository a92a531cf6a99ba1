"""The engine runs in one dedicated thread; the asyncio side talks to it through queues.

The engine is single-threaded (docs/ENGINE_API.md), so every engine call — construction
included — happens on this thread. Requests and aborts arrive through a thread-safe inbox that
the thread drains between steps; each step's outputs are handed to their requests'
``asyncio.Queue``s by one ``loop.call_soon_threadsafe`` per step (not one per request: each call
writes to the loop's self-pipe and wakes it). The event loop therefore never blocks on
the engine and keeps answering /health and accepting requests while a step runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

from adaspec.errors import InvalidRequestError
from adaspec.sampling_params import RequestOutputKind
from adaspec.serve.errors import APIError, QueueFullError

log = logging.getLogger("adaspec.serve")

ACCEPTED = object()  # first item on a request's queue once the engine took it


@dataclass(frozen=True)
class Chunk:
    """One engine step's news for one request, copied out of the engine's (mutable) output."""

    text: str  # cumulative text (stop-string partial matches already held back)
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    num_tokens: int  # cumulative generated tokens
    prompt_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None = None
    # the request's prompt logprobs and their ranks (engine/prompt_logprobs.py), on its first chunk
    # with tokens only: (entries, ranks)
    prompt_logprobs: tuple | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


async def accepted(q: asyncio.Queue, abort: Callable[[], None]) -> asyncio.Queue:
    """A request's queue once its first item says the engine took it; raises the refusal instead.
    A caller that goes away while waiting aborts the request (no orphan keeps running)."""
    try:
        first = await q.get()
    except asyncio.CancelledError:
        abort()
        raise
    if isinstance(first, BaseException):
        raise first
    return q


def _put_all(items) -> None:
    """On the event loop: one step's items into their requests' queues, in order."""
    for q, item in items:
        q.put_nowait(item)


class _Route:
    __slots__ = ("loop", "queue", "arrival", "sent", "prompt_tokens", "text", "text_of")

    def __init__(self, loop, q, arrival, prompt_tokens, text_of=None):
        self.loop, self.queue, self.arrival = loop, q, arrival
        self.sent = 0  # generated tokens already handed over
        self.prompt_tokens = prompt_tokens
        self.text = ""
        self.text_of = text_of  # engine_process.ApiText: the text is decoded here, not in the engine


class EngineThread:
    def __init__(self, engine_factory: Callable[[], Any], metrics_factory: Callable[[Any], Any] | None = None,
                 max_queue: int | None = None):
        self._factory = engine_factory
        self._metrics_factory = metrics_factory
        self.max_queue = max_queue
        self.metrics = None
        self.engine = None  # read-only attributes (tokenizer, model_name...) only, off-thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0  # submitted, not yet seen by the engine thread
        self._num_waiting = 0  # engine.num_waiting() after the engine thread's last look
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.error: BaseException | None = None  # set when a step raised: the engine is dead
        # called (on the engine thread) once the engine is dead: the server exits non-zero, as
        # vLLM does, so a supervisor restarts it instead of it answering 503 forever
        self.on_death: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="adaspec-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> "EngineThread":
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread and return its result (for tests, tools)."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut.result(timeout)

    def waiting_estimate(self) -> int:
        with self._lock:
            return self._pending_adds + self._num_waiting

    async def add(self, request_id: str, prompt: str | list[int], params, arrival: float,
                  prompt_tokens: int) -> asyncio.Queue:
        """Submit a request; returns its queue of Chunks once the engine has accepted it.

        Raises QueueFullError (503), InvalidRequestError (400) or APIError (engine dead).
        """
        if not self.alive:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        with self._lock:
            if self.max_queue is not None and self._pending_adds + self._num_waiting >= self.max_queue:
                raise QueueFullError(self.max_queue)
            self._pending_adds += 1
        q: asyncio.Queue = asyncio.Queue()
        self._inbox.put(("add", request_id, prompt, params, arrival, prompt_tokens,
                         asyncio.get_running_loop(), q))
        if not self._thread.is_alive():  # died between the check above and the put
            self._fail_pending(APIError(503, "The engine is not running.", code="engine_dead"))
        return await accepted(q, lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))

    def abort_all(self, reason: str = "abort") -> None:
        self._inbox.put(("abort_all", reason))

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, route: _Route, item) -> None:
        self._deliver_many(route.loop, [(route.queue, item)])

    @staticmethod
    def _deliver_many(loop, items: list[tuple[asyncio.Queue, Any]]) -> None:
        """Hand items to their queues with ONE wake-up of the event loop: call_soon_threadsafe
        writes to the loop's self-pipe each time, and one per request per step was about a fifth
        of the engine thread's time at 256 streaming requests (benchmarks/serve_overhead_bench.py)."""
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _snapshot_counts(self) -> None:
        with self._lock:
            self._num_waiting = self.engine.num_waiting()
        if self.metrics is not None:
            self.metrics.update_engine(self.engine)

    def _handle(self, cmd) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, arrival, ptoks, loop, q = cmd
            route = _Route(loop, q, arrival, ptoks)
            try:
                # each step's new tokens only (a copy, validated again: the caller's params stay as
                # they were), not a copy of the whole output so far every step
                params = dataclasses.replace(params, output_kind=RequestOutputKind.NEW_TOKENS)
                self.engine.add_request(rid, prompt, params, arrival_time=arrival)
            except InvalidRequestError as e:
                self._deliver(route, e)
            except Exception as e:  # noqa: BLE001 - reported to the client as a 500
                log.exception("add_request failed for %s", rid)
                self._deliver(route, APIError(500, f"The engine refused the request: {type(e).__name__}: {e}"))
            else:
                self._routes[rid] = route
                self._deliver(route, ACCEPTED)
            finally:
                with self._lock:
                    self._pending_adds -= 1
        elif kind == "abort":
            route = self._routes.pop(cmd[1], None)
            if route is not None:
                self.engine.abort_request(cmd[1])
                if self.metrics is not None:
                    self.metrics.on_finish(cmd[1], "abort", route.arrival)
        elif kind == "abort_all":
            for rid in list(self._routes):
                route = self._routes.pop(rid)
                self.engine.abort_request(rid)
                self._deliver(route, Chunk(route.text, [], None, route.sent, route.prompt_tokens, cmd[1]))
                if self.metrics is not None:
                    self.metrics.on_finish(rid, cmd[1], route.arrival)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        elif kind == "stop":
            return False
        return True

    def _publish(self, outputs) -> None:
        batches: dict[Any, list] = {}  # event loop -> [(queue, chunk)] of this step
        try:
            self._collect(outputs, batches)
        finally:  # what was collected goes out even if a later output raised (the engine then dies)
            for loop, items in batches.items():
                self._deliver_many(loop, items)

    def _collect(self, outputs, batches: dict) -> None:
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:  # aborted by us already
                continue
            comp = out.outputs[0]
            new_ids, lps = comp.token_ids, comp.logprobs  # RequestOutputKind.NEW_TOKENS (_handle)
            n = route.sent + len(new_ids)
            first = route.sent == 0 and n > 0
            finish = comp.finish_reason if out.finished else None
            if out.finished and finish is None:
                finish = "stop"
            if self.metrics is not None and n > route.sent:
                self.metrics.on_chunk(out.request_id, first, route.arrival, out.first_token_time)
            route.sent, route.text = n, comp.text
            chunk = Chunk(comp.text, new_ids, lps, n, route.prompt_tokens, finish, comp.stop_reason,
                          (out.prompt_logprobs, out.prompt_logprob_ranks) if first and out.prompt_logprobs else None)
            batches.setdefault(route.loop, []).append((route.queue, chunk))
            if out.finished:
                del self._routes[out.request_id]
                if self.metrics is not None:
                    self.metrics.on_finish(out.request_id, finish, route.arrival)

    def _run(self) -> None:
        try:
            self.engine = self._factory()
            if self._metrics_factory is not None:
                self.metrics = self._metrics_factory(self.engine)
        except BaseException as e:  # noqa: BLE001 - re-raised by start() in the caller's thread
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - the engine is dead; tell every client, then exit
            # Its state is unknown after a failed step (or abort, or bookkeeping), so no request
            # can continue. Request parameters are verified by add_request, so that no one
            # request can get here: what does is an engine fault.
            log.exception("the engine failed; the server shuts down")
            self._fail_all(e)
            if self.on_death is not None:
                self.on_death(e)
            return
        # stop: whoever still waits gets an abort
        self._handle(("abort_all", "abort"))
        self._fail_pending(APIError(503, "The server is shutting down.", code="shutting_down"))

    def _loop(self) -> None:
        """Take every queued command, step once, publish; until a stop command."""
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                cmd = self._inbox.get() if not busy else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if not self._handle(cmd):
                    return
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            self._snapshot_counts()
            if self.engine.has_unfinished_requests():
                self._publish(self.engine.step())
                self._snapshot_counts()

    def _fail_all(self, e: BaseException) -> None:
        self.error = e
        err = APIError(500, f"The engine failed: {type(e).__name__}: {e}", code="engine_error")
        for rid in list(self._routes):
            self._deliver(self._routes.pop(rid), err)
        self._fail_pending(err)

    def _fail_pending(self, err: APIError) -> None:
        # requests still in the inbox would otherwise wait forever for their ACCEPTED
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._deliver(_Route(cmd[6], cmd[7], 0.0, 0), err)
                with self._lock:
                    self._pending_adds -= 1
            elif cmd[0] == "call":
                cmd[2].set_exception(RuntimeError("engine thread stopped"))
