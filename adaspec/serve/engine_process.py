"""The engine in a process of its own (`adaspec serve --engine-process`), as vLLM's V1 engine core.

With the engine in a thread of the server's process (engine_thread.py), the engine's Python and
the event loop's (HTTP parsing, SSE formatting, one chunk per request per step) share one GIL: on
the H200 at 256 streaming requests the server made 4-7x fewer tokens per second than the offline
engine (BENCHMARKS.md). Here the engine runs in a child process (spawned: CUDA does not survive a
fork) and only small messages cross over, through one `multiprocessing` pipe per API server
process (one, or `--api-server-count`: api_servers.py; each request's news goes back through the
pipe that added it, and each pipe pulls its own batches):

- server -> engine: ("add", request_id, prompt, params, arrival), ("abort", request_id),
  ("abort_all",) (that server's requests), ("call", id, fn), ("stop",) (the first pipe only),
  ("bye",) (an extra API server stops: its requests are aborted);
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

With api_detokenize (`--api-detokenize`; on by default with more than one API server) the
engine makes no text for requests without stop strings (SamplingParams.detokenize=False): each
API server decodes its own requests' tokens as they come (ApiText), as vLLM's front end does. The
incremental decoding was the largest part of the engine's host work per step with many streams
(BENCHMARKS.md, H200 run 30), and the engine's one process is the serial part of the server;
spread over the API processes it runs beside the engine's steps. Stop strings stay matched in the
engine, which needs their text.

A failed step, or a child that exits for any reason (killed, out of memory), fails every open
request with a 500 and calls on_death: the server exits non-zero, as with the thread.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import threading
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from adaspec.errors import ConfigError, InvalidRequestError
from adaspec.sampling_params import RequestOutputKind
from adaspec.serve.engine_thread import ACCEPTED, Chunk, _put_all, _Route, accepted
from adaspec.serve.errors import APIError, QueueFullError
from adaspec.serve.metrics import ENGINE_STATS_READ
from adaspec.serve.state import LOG_FORMAT

log = logging.getLogger("adaspec.serve")

@dataclass
class EngineInfo:
    """What the HTTP side reads of the engine (serve/state.py): read-only after load."""

    tokenizer: Any
    max_model_len: int
    model_name: str
    sampling_defaults: dict = field(default_factory=dict)  # the model's recommended sampling (models/generation_defaults.py)
    grammar_waits_for_thinking: bool = False  # EngineConfig.reasoning_parser set (LLMEngine's property)


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
        for f in ENGINE_STATS_READ:  # the fields the metrics read, sent with every batch
            v = getattr(st, f, None)
            fields[f] = list(v) if isinstance(v, (list, tuple)) else dict(v) if isinstance(v, dict) else v
        return cls(engine.num_running(), engine.num_waiting(), engine.kv_blocks_total(), engine.kv_blocks_free(),
                   SimpleNamespace(**fields))


# ---------------------------------------------------------------------------------- the child
def merged_record(first: tuple, later: tuple) -> tuple:
    """Two consecutive records of one request (see _Outbox.records) as one: both steps' new tokens
    and logprobs, the later one's counts and finish, the text's change over both."""
    rid, ids1, lps1, _, suffix1, whole1, _, _, ftt1, plps1 = first
    _, ids2, lps2, n, suffix2, whole2, finish, stop_reason, ftt2, plps2 = later
    lps = None if lps1 is None and lps2 is None else (lps1 or []) + (lps2 or [])
    if whole2 is not None:  # the later text replaced the earlier one
        suffix, whole = "", whole2
    elif whole1 is not None:
        suffix, whole = "", whole1 + suffix2
    else:
        suffix, whole = suffix1 + suffix2, None
    return (rid, ids1 + ids2, lps, n, suffix, whole, finish, stop_reason, ftt1 if ftt1 is not None else ftt2,
            plps1 if plps1 is not None else plps2)


class ApiText:
    """The text of a request the engine does not decode (sent with detokenize=False), made in the
    API server as the engine's stop checker would make it: while the request runs, the complete
    characters of an incremental decode; once it ends on a stop token or its length, the whole
    output decoded at once (what the engine gives a finished request)."""

    __slots__ = ("tokenizer", "skip_special_tokens", "include_stop", "stream", "ids")

    def __init__(self, tokenizer, skip_special_tokens: bool, include_stop: bool = False):
        self.tokenizer, self.skip_special_tokens, self.include_stop = tokenizer, skip_special_tokens, include_stop
        self.stream = tokenizer.decode_stream(skip_special_tokens)
        self.ids: list[int] = []

    def text(self, new_ids: list[int], finish: str | None) -> str:
        """The text after these new tokens (finish: the request's finish reason, None while it runs;
        such a request has no stop strings, so "stop" means a stop token, kept out of the text
        unless include_stop_str_in_output, as the engine's)."""
        self.ids.extend(new_ids)
        if finish in ("stop", "length"):
            ids = self.ids[:-1] if finish == "stop" and not self.include_stop else self.ids
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        step = self.stream.step
        for tok in new_ids:
            step(tok)
        return self.stream.text


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
        finish_reason (None while running), stop_reason, first_token_time, prompt logprobs (with the
        first tokens only, else None)) per output. The
        outputs are RequestOutputKind.NEW_TOKENS ones (_handle asks the engine for those): their
        token ids and logprobs are the step's new ones already."""
        out = []
        for o in outputs:
            rid, comp = o.request_id, o.outputs[0]
            new_ids, lps = comp.token_ids, comp.logprobs
            before = self.sent.get(rid, 0)
            n = before + len(new_ids)
            prompt_lps = (o.prompt_logprobs, o.prompt_logprob_ranks) if before == 0 and new_ids and o.prompt_logprobs \
                else None
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
            out.append((rid, new_ids, lps, n, suffix, whole, finish, comp.stop_reason, o.first_token_time, prompt_lps))
        return out


def _picklable_error(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception that does not survive the pipe
        return RuntimeError(f"{type(e).__name__}: {e}")


def _engine_main(factory: Callable[[], Any], conns, log_level: int = logging.INFO) -> None:
    """The child: build the engine, then take commands, step, report; until ("stop",) or the first
    pipe closes (the server is gone). ``conns``: the pipe of each API server, the owner's first."""
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
        conns[0].send(("load_error", _picklable_error(e)))
        return
    info = EngineInfo(engine.tokenizer, int(engine.max_model_len), str(getattr(engine, "model_name", "")),
                      dict(getattr(engine, "sampling_defaults", {}) or {}),
                      bool(getattr(engine, "grammar_waits_for_thinking", False)))
    for conn in conns:
        conn.send(("ready", info))
    gc.collect()  # as the server's freeze_startup_objects: full collections then skip the model's objects
    gc.freeze()
    serve_engine(engine, conns)


class _Client:
    """One API server's pipe as the child sees it: what it has been sent, what waits for it."""

    __slots__ = ("conn", "outbox", "acks", "unanswered", "steps_seen", "counts_seen")

    def __init__(self, conn):
        self.conn = conn
        self.outbox = _Outbox()
        self.acks: list[tuple] = []
        self.unanswered = 0  # batches sent that this server has not asked "more" after yet
        self.steps_seen = None  # the engine's step count in the last snapshot sent
        self.counts_seen = (0, 0)  # the engine's (running, waiting) in the last snapshot sent

    def due(self) -> bool:
        """Acks go at once (a request's first token waits on its ack), news when the server is ready."""
        return bool(self.acks) or (bool(self.outbox.pending) and self.unanswered <= 0)


def serve_engine(engine, conns) -> None:
    """The child's loop over a loaded engine: take commands, step, send batches when a server has
    asked for them (see the module's docstring); until ("stop",) from the first pipe or the first
    pipe closes. ``conns``: one pipe, or one per API server (``--api-server-count``): each
    request's news goes back through the pipe that added it, each pipe pulls its own batches.
    Raises SystemExit(1) after reporting a failed step."""
    clients = [_Client(c) for c in (conns if isinstance(conns, (list, tuple)) else [conns])]
    owner: dict[str, _Client] = {}  # request id -> the client that added it (until it finishes)

    def take_commands(block: bool) -> bool:
        """Handle what the servers sent (waiting for something first if ``block``); False on stop."""
        if block:
            multiprocessing.connection.wait([c.conn for c in clients])
        for client in list(clients):
            try:
                while client.conn.poll(0):
                    cmd = client.conn.recv()
                    kind = cmd[0]
                    if kind == "more":
                        client.unanswered -= 1
                    elif kind == "bye" and client is not clients[0]:  # an extra API server stops
                        _drop(engine, client, clients, owner)
                        client.conn.close()  # its reader sees the end
                        break
                    elif kind == "stop" and client is clients[0]:  # the owner's only
                        shutdown = getattr(engine, "shutdown", None)  # tensor-parallel workers, if any
                        if shutdown is not None:
                            shutdown()
                        return False
                    else:
                        _handle(engine, cmd, client, owner)
            except (EOFError, OSError):
                if client is clients[0]:
                    raise  # the server that owns this process is gone
                _drop(engine, client, clients, owner)  # an extra API server is gone: its requests too
        return True

    def route(outputs) -> None:
        by_client: dict[_Client, list] = {}
        for o in outputs:
            client = owner.get(o.request_id)
            if client is None:
                continue
            by_client.setdefault(client, []).append(o)
            if o.finished:
                del owner[o.request_id]
        for client, outs in by_client.items():
            client.outbox.add_step(outs)

    try:
        while True:
            # idle: wait for work (news still pending here waits for its server's "more")
            if not take_commands(block=not engine.has_unfinished_requests()):
                return
            if engine.has_unfinished_requests():
                route(engine.step())
                # a server's "more" for its last batch usually came in while this step ran: look
                # now, or each batch would wait a step more and carry two steps' news
                if any(c.outbox.pending and c.unanswered > 0 for c in clients) and not take_commands(block=False):
                    return
            snapshot = None
            steps = getattr(engine.stats, "num_steps", None)
            counts = (engine.num_running(), engine.num_waiting())
            for client in list(clients):  # (a server whose pipe broke is dropped from clients)
                # with several servers each gets every step's snapshot (once it has asked for more),
                # even when the step had no news for it: the first adds the engine's counters to the
                # metrics (metrics.py), and each checks --max-queue against the engine's waiting count.
                # Any server gets one when the counts moved without news for it (its own requests
                # aborted, e.g. clients that went away): else its --max-queue check and its gauges
                # kept the old counts, and a full queue refused every request while the engine idled
                stale = client.unanswered <= 0 and ((len(clients) > 1 and client.steps_seen != steps)
                                                    or client.counts_seen != counts)
                if client.due() or stale:
                    snapshot = snapshot or EngineSnapshot.of(engine)
                    client.steps_seen, client.counts_seen = steps, (snapshot.running, snapshot.waiting)
                    acks, client.acks = client.acks, []
                    try:
                        client.conn.send(("batch", acks, client.outbox.take(), snapshot))
                    except (EOFError, OSError):
                        if client is clients[0]:
                            raise
                        _drop(engine, client, clients, owner)
                        continue
                    client.unanswered += 1
    except (EOFError, OSError):  # the server is gone
        return
    except BaseException as e:  # noqa: BLE001 - the engine is dead: say why, then exit non-zero
        log.exception("the engine failed")
        try:
            for client in clients:
                try:
                    client.conn.send(("died", _picklable_error(e)))
                except (EOFError, OSError):
                    pass
        finally:
            raise SystemExit(1)


def _abort_all_of(engine, client: _Client, owner: dict) -> int:
    """Abort every request ``client`` added. -> how many."""
    mine = [rid for rid, c in owner.items() if c is client]
    for rid in mine:
        engine.abort_request(rid)
        del owner[rid]
        client.outbox.forget(rid)
    return len(mine)


def _drop(engine, client: _Client, clients: list, owner: dict) -> None:
    """An API server other than the first stopped or closed its pipe: abort what it had added."""
    aborted = _abort_all_of(engine, client, owner)
    if aborted:
        log.warning("an API server left with %d request(s) running: aborted them", aborted)
    clients.remove(client)


def _handle(engine, cmd, client: _Client, owner: dict) -> None:
    kind = cmd[0]
    if kind == "add":
        _, rid, prompt, params, arrival = cmd
        # this process's own copy: each step's news carries the new tokens only, not a copy of the
        # whole output so far (the outbox sends only what is new anyway)
        params.output_kind = RequestOutputKind.NEW_TOKENS
        # refusals cross the pipe as plain tuples (exceptions with extra fields do not all pickle)
        try:
            engine.add_request(rid, prompt, params, arrival_time=arrival)
        except InvalidRequestError as e:
            client.acks.append((rid, ("invalid", str(e), e.param)))
        except Exception as e:  # noqa: BLE001 - reported to the client as a 500
            log.exception("add_request failed for %s", rid)
            client.acks.append((rid, ("error", f"The engine refused the request: {type(e).__name__}: {e}", None)))
        else:
            client.acks.append((rid, None))
            owner[rid] = client
    elif kind == "abort":
        if owner.get(cmd[1]) is client:  # a server aborts only its own requests
            engine.abort_request(cmd[1])
            del owner[cmd[1]]
        client.outbox.forget(cmd[1])
    elif kind == "abort_all":  # this server's requests
        _abort_all_of(engine, client, owner)
    elif kind == "call":
        _, call_id, fn = cmd
        try:
            client.conn.send(("call", call_id, True, fn(engine)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            client.conn.send(("call", call_id, False, _picklable_error(e)))


# ---------------------------------------------------------------------------------- the server
class EngineLink:
    """EngineThread's interface over one pipe to the engine process: routes each request's news to
    its queue. EngineProcess (which owns the process) and EngineClient (an extra API server's
    link, ``--api-server-count``) differ only in how the link starts, stops and tells the engine
    is alive."""

    def __init__(self, conn, metrics_factory: Callable[[Any], Any] | None = None, max_queue: int | None = None,
                 api_detokenize: bool = False):
        self._conn = conn
        self._metrics_factory = metrics_factory
        self.max_queue = max_queue
        self.api_detokenize = api_detokenize  # decode here the text of requests without stop strings
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
        self._reader = threading.Thread(target=self._read, name="adaspec-engine-reader", daemon=True)

    def _ready(self, payload: EngineInfo) -> None:
        self.engine = payload
        if self._metrics_factory is not None:
            self.metrics = self._metrics_factory(self.engine)
        self._reader.start()

    def _engine_alive(self) -> bool:
        raise NotImplementedError

    def _gone(self) -> BaseException:
        """The error for a pipe that closed while we were not stopping."""
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self._engine_alive() and self.error is None and self.engine is not None

    # ------------------------------------------------------------------ any thread
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
        text_of = None
        tokenizer = self.engine.tokenizer
        if self.api_detokenize and tokenizer is not None and params.detokenize and not params.stop:
            params = dataclasses.replace(params, detokenize=False)  # a copy: the caller's stays as it was
            text_of = ApiText(tokenizer, params.skip_special_tokens, params.include_stop_str_in_output)
        with self._lock:
            if self.error is not None:  # died after the check above (the reader holds this lock to fail routes)
                raise APIError(503, "The engine is not running.", code="engine_dead")
            if self.max_queue is not None and self._pending_adds + self._num_waiting >= self.max_queue:
                raise QueueFullError(self.max_queue)
            self._pending_adds += 1
            self._routes[request_id] = _Route(asyncio.get_running_loop(), q, arrival, prompt_tokens, text_of)
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
                self._die(self._gone())
        except Exception as e:  # noqa: BLE001 - a message we cannot read: the two sides no longer agree
            self._unreadable()
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
            for rid, new_ids, lps, n, suffix, whole, finish, stop_reason, first_token_time, prompt_lps in records:
                route = self._routes.get(rid)
                if route is None:  # aborted by us already
                    continue
                first = route.sent == 0 and n > 0
                if metrics is not None and n > route.sent:
                    metrics.on_chunk(rid, first, route.arrival, first_token_time)
                route.sent = n
                if route.text_of is not None:
                    route.text = route.text_of.text(new_ids, finish)
                else:
                    route.text = whole if whole is not None else route.text + suffix
                chunk = Chunk(route.text, new_ids, lps, n, route.prompt_tokens, finish, stop_reason, prompt_lps)
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

    def _unreadable(self) -> None:
        """A message we cannot read came: the link is unusable."""


class EngineProcess(EngineLink):
    """EngineThread's interface, with the engine in a spawned child process. engine_factory must
    be picklable (a module-level function, or functools.partial of one). ``extra_api_servers``:
    one more pipe to the child for each further API server process (``--api-server-count``); their
    ends are ``client_conns``, for EngineClient in those processes."""

    def __init__(self, engine_factory: Callable[[], Any], metrics_factory: Callable[[Any], Any] | None = None,
                 max_queue: int | None = None, start_timeout: float | None = None, extra_api_servers: int = 0,
                 api_detokenize: bool = False):
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe(duplex=True)
        super().__init__(conn, metrics_factory, max_queue, api_detokenize)
        self._factory = engine_factory
        self.start_timeout = start_timeout
        extra = [ctx.Pipe(duplex=True) for _ in range(extra_api_servers)]
        self.client_conns = [ours for ours, _ in extra]
        self._child_conns = [child_conn] + [theirs for _, theirs in extra]
        # not a daemon: the engine may start processes of its own (tensor-parallel workers), which a
        # daemonic process may not. It ends when the pipe closes (this process gone) or on stop(),
        # which an exit handler calls if nobody did (multiprocessing would otherwise wait for it)
        self._process = ctx.Process(target=_engine_main,
                                    args=(engine_factory, self._child_conns, logging.getLogger().getEffectiveLevel()),
                                    name="adaspec-engine", daemon=False)

    def start(self) -> "EngineProcess":
        try:
            self._process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as e:  # what spawn raises for a lambda or closure
            raise ConfigError(f"the engine process needs a picklable engine factory (a module-level function, or "
                              f"functools.partial of one), got {self._factory!r}: {e}") from None
        atexit.register(_stop_at_exit, weakref.ref(self))
        for c in self._child_conns:  # ours would keep the pipes open after the child dies: no EOF
            c.close()
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
        self._ready(payload)
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

    def _engine_alive(self) -> bool:
        return self._process.is_alive()

    def _gone(self) -> BaseException:
        self._process.join(5)
        return RuntimeError(f"the engine process exited (exit code {self._process.exitcode})")

    def _unreadable(self) -> None:
        self._process.kill()


class EngineClient(EngineLink):
    """An extra API server's link to the engine process another process owns (EngineProcess's
    ``client_conns``): the same routing; the owner starts and stops the engine."""

    def start(self, timeout: float | None = None) -> "EngineClient":
        if not self._conn.poll(timeout):
            raise RuntimeError(f"the engine process did not answer within {timeout} s")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError("the engine process exited while loading") from None
        if kind != "ready":
            raise RuntimeError(f"the engine process sent {kind!r} before it was ready")
        self._ready(payload)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._send_quietly(("bye",))  # the child drops this server's requests and closes its end
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._fail_all(APIError(503, "The server is shutting down.", code="shutting_down"))

    def _engine_alive(self) -> bool:
        return self._reader.is_alive()

    def _gone(self) -> BaseException:
        return RuntimeError("the engine process exited")


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
