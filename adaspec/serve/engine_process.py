"""The engine in a process of its own (`adaspec serve --engine-process`), as vLLM's V1 engine core.

With the engine in a thread of the server's process (engine_thread.py), the engine's Python and
the event loop's (HTTP parsing, SSE formatting, one chunk per request per step) share one GIL: on
the H200 at 256 streaming requests the server made 4-7x fewer tokens per second than the offline
engine (BENCHMARKS.md). Here the engine runs in a child process (spawned: CUDA does not survive a
fork) and only small messages cross over, through one `multiprocessing` pipe:

- server -> engine: ("add", request_id, prompt, params, arrival), ("abort", request_id),
  ("abort_all",), ("call", id, fn), ("stop",);
- engine -> server: ("batch", acks, records, snapshot): the adds it accepted or refused, per
  request only what is NEW since the last batch (token ids, logprobs, the text's new suffix), and
  the counters the metrics need;
- server -> engine: ("more",) once the event loop has handed a batch's chunks to their streams.

In the server, a reader thread turns each batch into Chunks (engine_thread.Chunk, the same
objects the routes get from the thread) and hands them to the event loop with one wake-up per
loop. The interface is EngineThread's (add, abort, abort_all, call, alive, metrics, engine,
on_death), so the rest of the server does not know which one it talks to.

Batches are pulled, not pushed: the engine sends its news only when the server has taken the
previous batch (or when it has adds to acknowledge, which a request's first token waits on), and
merges each request's news over the steps in between. Pushed once per step, the batches cost
the server's one GIL a record per request per step whatever it could stream: on the H200 at 256
streams the engine stepped every ~3 ms while each stream's chunks left every ~23 ms carrying 9.3
tokens (BENCHMARKS.md, run 19), so about 8 of 9 records were unpacked, published and merged again
for nothing, and a request's first token waited ~0.7 s. Pulled, the server handles as many
records per second as it can stream, and no more.

A failed step, or a child that exits for any reason (killed, out of memory), fails every open
request with a 500 and calls on_death: the server exits non-zero, as with the thread.
"""
from __future__ import annotations

import asyncio
import atexit
import gc
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

from adaspec.errors import ConfigError, InvalidRequestError
from adaspec.serve.engine_thread import ACCEPTED, Chunk, _put_all, _Route, accepted
from adaspec.serve.errors import APIError, QueueFullError
from adaspec.serve.state import LOG_FORMAT

log = logging.getLogger("adaspec.serve")

# engine.stats fields the metrics read (serve/metrics.py), sent with every batch
_SNAPSHOT_STATS = ("num_prompt_tokens", "num_generated_tokens", "num_preemptions", "num_steps", "num_drafts",
                   "num_draft_tokens", "num_accepted_tokens", "num_verified_tokens", "num_steps_draft_skipped",
                   "accepted_per_pos", "verified_per_pos", "predicted_accept_per_pos", "budget_hist",
                   "synthetic_acceptance")


@dataclass
class EngineInfo:
    """What the HTTP side reads of the engine (serve/state.py): read-only after load."""

    tokenizer: Any
    max_model_len: int
    model_name: str


@dataclass
class EngineSnapshot:
    """The engine's counts after a step, shaped as ServerMetrics.update_engine reads an engine."""

    running: int
    waiting: int
    blocks_total: int
    blocks_free: int
    stats: SimpleNamespace

    def num_running(self) -> int:
        return self.running

    def num_waiting(self) -> int:
        return self.waiting

    def kv_blocks_total(self) -> int:
        return self.blocks_total

    def kv_blocks_free(self) -> int:
        return self.blocks_free

    @classmethod
    def of(cls, engine) -> "EngineSnapshot":
        st = engine.stats
        fields = {}
        for f in _SNAPSHOT_STATS:
            v = getattr(st, f, None)
            fields[f] = list(v) if isinstance(v, (list, tuple)) else dict(v) if isinstance(v, dict) else v
        return cls(engine.num_running(), engine.num_waiting(), engine.kv_blocks_total(), engine.kv_blocks_free(),
                   SimpleNamespace(**fields))


# ---------------------------------------------------------------------------------- the child
def merged_record(first: tuple, later: tuple) -> tuple:
    """Two consecutive records of one request (see _Outbox.records) as one: both steps' new tokens
    and logprobs, the later one's counts and finish, the text's change over both."""
    rid, ids1, lps1, _, suffix1, whole1, _, _, ftt1 = first
    _, ids2, lps2, n, suffix2, whole2, finish, stop_reason, ftt2 = later
    lps = None if lps1 is None and lps2 is None else (lps1 or []) + (lps2 or [])
    if whole2 is not None:  # the later text replaced the earlier one
        suffix, whole = "", whole2
    elif whole1 is not None:
        suffix, whole = "", whole1 + suffix2
    else:
        suffix, whole = suffix1 + suffix2, None
    return (rid, ids1 + ids2, lps, n, suffix, whole, finish, stop_reason, ftt1 if ftt1 is not None else ftt2)


class _Outbox:
    """The child's view of what each request has been sent already (tokens, text), and the news
    not yet sent, merged per request until the server asks for more."""

    def __init__(self):
        self.sent: dict[str, int] = {}
        self.text: dict[str, str] = {}
        self.pending: dict[str, tuple] = {}  # request id -> its merged record, in first-news order

    def add_step(self, outputs) -> None:
        pending = self.pending
        for rec in self.records(outputs):
            old = pending.get(rec[0])
            pending[rec[0]] = rec if old is None else merged_record(old, rec)

    def take(self) -> list[tuple]:
        out, self.pending = list(self.pending.values()), {}
        return out

    def forget(self, request_id: str) -> None:
        """An aborted request: nothing more goes out for it (the server has dropped its route)."""
        self.sent.pop(request_id, None)
        self.text.pop(request_id, None)
        self.pending.pop(request_id, None)

    def records(self, outputs) -> list[tuple]:
        """(request_id, new token ids, new logprobs, tokens in all, text suffix, whole text or None,
        finish_reason (None while running), stop_reason, first_token_time) per output."""
        out = []
        for o in outputs:
            rid, comp = o.request_id, o.outputs[0]
            n, sent = len(comp.token_ids), self.sent.get(rid, 0)
            new_ids = list(comp.token_ids[sent:n])
            lps = list(comp.logprobs[sent:n]) if comp.logprobs is not None else None
            prev, text = self.text.get(rid, ""), comp.text
            # the exposed text only grows (stop-string prefixes are held back): send its suffix
            suffix, whole = (text[len(prev):], None) if text.startswith(prev) else ("", text)
            finish = None
            if o.finished:
                finish = comp.finish_reason or "stop"
                self.sent.pop(rid, None)
                self.text.pop(rid, None)
            else:
                self.sent[rid], self.text[rid] = n, text
            out.append((rid, new_ids, lps, n, suffix, whole, finish, comp.stop_reason, o.first_token_time))
        return out


def _picklable_error(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception that does not survive the pipe
        return RuntimeError(f"{type(e).__name__}: {e}")


def _engine_main(factory: Callable[[], Any], conn, log_level: int = logging.INFO) -> None:
    """The child: build the engine, then take commands, step, report; until ("stop",) or the pipe
    closes (the server is gone)."""
    # Ctrl-C and SIGTERM reach the whole process group (a terminal, systemd, `timeout`, kill -TERM
    # -PGID): the server drains on either and stops us itself, so we must not die first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # spawned: nothing of the server's logging config came along (the engine's INFO lines, e.g.
    # "engine ready", would be lost); the same level and format as the server's
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        engine = factory()
    except BaseException as e:  # noqa: BLE001 - re-raised by start() in the server
        conn.send(("load_error", _picklable_error(e)))
        return
    conn.send(("ready", EngineInfo(engine.tokenizer, int(engine.max_model_len),
                                   str(getattr(engine, "model_name", "")))))
    gc.collect()  # as the server's freeze_startup_objects: full collections then skip the model's objects
    gc.freeze()
    serve_engine(engine, conn)


def serve_engine(engine, conn) -> None:
    """The child's loop over a loaded engine: take commands, step, send batches when the server
    has asked for them (see the module's docstring); until ("stop",) or the pipe closes. Raises
    SystemExit(1) after reporting a failed step."""
    outbox = _Outbox()
    unanswered = 0  # batches sent that the server has not asked "more" after yet

    def take_commands(acks: list, block: bool) -> bool:
        """Handle what the server sent (waiting for something first if ``block``); False on stop."""
        nonlocal unanswered
        cmds = [conn.recv()] if block else []
        while conn.poll(0):
            cmds.append(conn.recv())
        for cmd in cmds:
            kind = cmd[0]
            if kind == "more":
                unanswered -= 1
            elif kind == "stop":
                shutdown = getattr(engine, "shutdown", None)  # tensor-parallel workers, if any
                if shutdown is not None:
                    shutdown()
                return False
            else:
                _handle(engine, cmd, acks, conn, outbox)
        return True

    try:
        while True:
            acks: list[tuple] = []
            # idle: wait for work (news still pending here waits for the server's "more")
            if not take_commands(acks, block=not engine.has_unfinished_requests()):
                return
            if engine.has_unfinished_requests():
                outbox.add_step(engine.step())
                # the server's "more" for the last batch usually came in while this step ran: look
                # now, or each batch would wait a step more and carry two steps' news
                if outbox.pending and unanswered > 0 and not take_commands(acks, block=False):
                    return
            # acks go at once (a request's first token waits on its ack), news when the server is ready
            if acks or (outbox.pending and unanswered <= 0):
                conn.send(("batch", acks, outbox.take(), EngineSnapshot.of(engine)))
                unanswered += 1
    except (EOFError, OSError):  # the server is gone
        return
    except BaseException as e:  # noqa: BLE001 - the engine is dead: say why, then exit non-zero
        log.exception("the engine failed")
        try:
            conn.send(("died", _picklable_error(e)))
        finally:
            raise SystemExit(1)


def _handle(engine, cmd, acks: list, conn, outbox: _Outbox) -> None:
    kind = cmd[0]
    if kind == "add":
        _, rid, prompt, params, arrival = cmd
        # refusals cross the pipe as plain tuples (exceptions with extra fields do not all pickle)
        try:
            engine.add_request(rid, prompt, params, arrival_time=arrival)
        except InvalidRequestError as e:
            acks.append((rid, ("invalid", str(e), e.param)))
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500
            log.exception("add_request failed for %s", rid)
            acks.append((rid, ("error", f"The engine refused the request: {type(e).__name__}: {e}", None)))
        else:
            acks.append((rid, None))
    elif kind == "abort":
        engine.abort_request(cmd[1])
        outbox.forget(cmd[1])
    elif kind == "abort_all":
        for rid in list(engine.requests):
            engine.abort_request(rid)
            outbox.forget(rid)
    elif kind == "call":
        _, call_id, fn = cmd
        try:
            conn.send(("call", call_id, True, fn(engine)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            conn.send(("call", call_id, False, _picklable_error(e)))


# ---------------------------------------------------------------------------------- the server
class EngineProcess:
    """EngineThread's interface, with the engine in a spawned child process. engine_factory must
    be picklable (a module-level function, or functools.partial of one)."""

    def __init__(self, engine_factory: Callable[[], Any], metrics_factory: Callable[[Any], Any] | None = None,
                 max_queue: int | None = None, start_timeout: float | None = None):
        self._factory = engine_factory
        self._metrics_factory = metrics_factory
        self.max_queue = max_queue
        self.start_timeout = start_timeout
        self.metrics = None
        self.engine: EngineInfo | None = None
        self.error: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()  # routes and counters (any thread); never held while the pipe blocks
        # sends on the pipe (any thread). Not _lock: a send blocks while the child, itself blocked
        # sending a step's batch, waits for the reader thread, which needs _lock to publish it
        self._send_lock = threading.Lock()
        self._pending_adds = 0
        self._num_waiting = 0
        self._calls: dict[int, Any] = {}
        self._call_ids = itertools.count()
        self._stopping = False
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        # not a daemon: the engine may start processes of its own (tensor-parallel workers), which a
        # daemonic process may not. It ends when the pipe closes (this process gone) or on stop(),
        # which an exit handler calls if nobody did (multiprocessing would otherwise wait for it)
        self._process = ctx.Process(target=_engine_main,
                                    args=(engine_factory, child_conn, logging.getLogger().getEffectiveLevel()),
                                    name="adaspec-engine", daemon=False)
        self._child_conn = child_conn
        self._reader = threading.Thread(target=self._read, name="adaspec-engine-reader", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> "EngineProcess":
        try:
            self._process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as e:  # what spawn raises for a lambda or closure
            raise ConfigError(f"the engine process needs a picklable engine factory (a module-level function, or "
                              f"functools.partial of one), got {self._factory!r}: {e}") from None
        atexit.register(_stop_at_exit, weakref.ref(self))
        self._child_conn.close()  # ours would keep the pipe open after the child dies: no EOF
        if not self._conn.poll(self.start_timeout):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {self.start_timeout} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while loading (exit code {self._process.exitcode})") \
                from None
        if kind == "load_error":
            self._process.join(5)
            raise payload
        self.engine = payload
        if self._metrics_factory is not None:
            self.metrics = self._metrics_factory(self.engine)
        self._reader.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self._process.is_alive():
            self._send_quietly(("stop",))
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        if self._reader.is_alive():
            self._reader.join(5)
        self._fail_all(APIError(503, "The server is shutting down.", code="shutting_down"))

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self.error is None and self.engine is not None

    def call(self, fn: Callable[[Any], Any], timeout: float | None = 30.0) -> Any:
        """Run ``fn(engine)`` in the engine process (fn and its result must be picklable)."""
        import concurrent.futures

        if not self.alive:
            raise RuntimeError("the engine process is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self._send(("call", call_id, fn))
        return fut.result(timeout)

    def waiting_estimate(self) -> int:
        with self._lock:
            return self._pending_adds + self._num_waiting

    async def add(self, request_id: str, prompt: str | list[int], params, arrival: float,
                  prompt_tokens: int) -> asyncio.Queue:
        """As EngineThread.add: the request's queue of Chunks once the engine has accepted it."""
        if not self.alive:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.error is not None:  # died after the check above (the reader holds this lock to fail routes)
                raise APIError(503, "The engine is not running.", code="engine_dead")
            if self.max_queue is not None and self._pending_adds + self._num_waiting >= self.max_queue:
                raise QueueFullError(self.max_queue)
            self._pending_adds += 1
            self._routes[request_id] = _Route(asyncio.get_running_loop(), q, arrival, prompt_tokens)
        try:
            self._send(("add", request_id, prompt, params, arrival))
        except (OSError, ValueError):  # the pipe is closed: the process is gone (the reader fails the route)
            pass
        return await accepted(q, lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        with self._lock:
            route = self._routes.pop(request_id, None)
        if route is None:
            return
        if self.metrics is not None:
            self.metrics.on_finish(request_id, "abort", route.arrival)
        self._send_quietly(("abort", request_id))

    def abort_all(self, reason: str = "abort") -> None:
        with self._lock:
            routes, self._routes = self._routes, {}
        for rid, route in routes.items():
            _deliver(route.loop, [(route.queue, Chunk(route.text, [], None, route.sent, route.prompt_tokens, reason))])
            if self.metrics is not None:
                self.metrics.on_finish(rid, reason, route.arrival)
        self._send_quietly(("abort_all",))

    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _send_quietly(self, msg) -> None:
        try:
            self._send(msg)
        except (OSError, ValueError):  # the process is gone: nothing left to abort
            pass

    # ------------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "batch":
                    self._publish(*msg[1:])  # asks for the next batch once the event loop has this one
                elif kind == "call":
                    _, call_id, ok, value = msg
                    with self._lock:
                        fut = self._calls.pop(call_id, None)
                    if fut is not None:
                        (fut.set_result if ok else fut.set_exception)(value)
                elif kind == "died":
                    self._die(msg[1])
                    return
        except (EOFError, OSError):
            if not self._stopping:
                self._process.join(5)
                self._die(RuntimeError(f"the engine process exited (exit code {self._process.exitcode})"))
        except Exception as e:  # noqa: BLE001 - a message we cannot read: the two sides no longer agree
            self._process.kill()
            self._die(e)

    def _die(self, error: BaseException) -> None:
        log.error("the engine failed (%s: %s)", type(error).__name__, error)
        self.error = error
        self._fail_all(APIError(500, f"The engine failed: {type(error).__name__}: {error}", code="engine_error"))
        if self.on_death is not None:
            self.on_death(error)

    def _fail_all(self, err: APIError) -> None:
        with self._lock:
            routes, self._routes = self._routes, {}
            calls, self._calls = self._calls, {}
            self._pending_adds = 0
        for route in routes.values():
            _deliver(route.loop, [(route.queue, err)])
        for fut in calls.values():
            fut.set_exception(RuntimeError("the engine process stopped"))

    def _publish(self, acks, records, snapshot: EngineSnapshot) -> None:
        batches: dict[Any, list] = {}  # event loop -> [(queue, item)] of this batch
        metrics = self.metrics
        with self._lock:
            self._num_waiting = snapshot.waiting
            for rid, refusal in acks:
                self._pending_adds -= 1
                route = self._routes.get(rid) if refusal is None else self._routes.pop(rid, None)
                if route is not None:
                    batches.setdefault(route.loop, []).append((route.queue, _ack_item(refusal)))
            finished = []
            for rid, new_ids, lps, n, suffix, whole, finish, stop_reason, first_token_time in records:
                route = self._routes.get(rid)
                if route is None:  # aborted by us already
                    continue
                first = route.sent == 0 and n > 0
                if metrics is not None and n > route.sent:
                    metrics.on_chunk(rid, first, route.arrival, first_token_time)
                route.sent = n
                route.text = whole if whole is not None else route.text + suffix
                chunk = Chunk(route.text, new_ids, lps, n, route.prompt_tokens, finish, stop_reason)
                batches.setdefault(route.loop, []).append((route.queue, chunk))
                if finish is not None:
                    del self._routes[rid]
                    finished.append((rid, finish, route.arrival))
        if metrics is not None:
            for rid, finish, arrival in finished:
                metrics.on_finish(rid, finish, arrival)
            metrics.update_engine(snapshot)
        if not batches:
            self._ask_for_more()
            return
        # "more" once every event loop concerned has run its items and the streams they woke
        left = [len(batches)]

        def one_loop_done() -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._ask_for_more()

        for loop, items in batches.items():
            _deliver(loop, items, one_loop_done)

    def _ask_for_more(self) -> None:
        self._send_quietly(("more",))


def _stop_at_exit(ref) -> None:
    engine_process = ref()
    if engine_process is not None and engine_process._process.is_alive():
        engine_process.stop(timeout=10.0)


def _ack_item(refusal: tuple | None):
    """What add() receives first: ACCEPTED, or the refusal as the exception the thread would raise."""
    if refusal is None:
        return ACCEPTED
    kind, message, param = refusal
    if kind == "invalid":
        return InvalidRequestError(message, param=param)
    return APIError(500, message)


def _deliver(loop, items, then: Callable[[], None] | None = None) -> None:
    """One wake-up of the event loop for all of a batch's items (see EngineThread._deliver_many);
    ``then`` runs on the loop after the tasks the items woke have run their next steps (their
    chunks written), or at once if the loop is closed."""
    try:
        loop.call_soon_threadsafe(_put_all_then, items, then)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        if then is not None:
            then()


def _put_all_then(items, then: Callable[[], None] | None) -> None:
    _put_all(items)
    if then is not None:  # queued behind the wake-ups _put_all scheduled
        asyncio.get_running_loop().call_soon(then)
