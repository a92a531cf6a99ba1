"""One HTTP request's generations: submit, stream or collect, and abort when the client leaves.

A completions request may carry a batch of prompts (as in OpenAI and vLLM), and any request n
samples of each: each sample of each prompt becomes its own engine request (seeds as the engine's
own fan-out gives them, engine/parallel_sampling.py) and its own choice, ``index`` = prompt * n +
sample, as OpenAI numbers them; the usage counts each prompt's tokens once. Whatever ends a request early — a client
disconnect, a cancelled task, a server drain — goes through ``_Generation.close``, which aborts
it in the engine (freeing its KV blocks) exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from adaspec.engine.parallel_sampling import child_params
from adaspec.serve.engine_thread import Chunk
from adaspec.serve.errors import APIError, QueueFullError, error_body
from adaspec.serve.formatting import SSE_DONE, Formatter, sse, usage
from adaspec.serve.state import ServeState

log = logging.getLogger("adaspec.serve")

_CLIENT_GONE = object()


class _ClientGone(Exception):
    pass


class _Generation:
    def __init__(self, state: ServeState, rid: str, q: asyncio.Queue, index: int, prompt_ids: list[int],
                 counts_prompt: bool = True):
        self.state, self.rid, self.q = state, rid, q
        self.index, self.prompt_ids, self.prompt_tokens = index, prompt_ids, len(prompt_ids)
        self.echo_text: str | None = None  # completions' echo: the prompt's text before the choice's
        self.hides_output = False  # echo without generation: its one token is not returned nor counted
        self.counts_prompt = counts_prompt  # the usage counts a prompt once, whatever its n
        self.num_tokens = 0
        self.finished = False
        self.closed = False
        self._held = None  # an item taken from the queue while merging that is not a chunk
        state.inflight += 1

    async def next(self) -> Chunk:
        """The next chunk; chunks already queued behind it come merged into it (as vLLM's output
        collector merges them): when the event loop falls behind the engine, each stream then
        costs one event and one socket write per turn instead of one per engine step, which is
        what let the backlog grow (on a 2-core machine at 256 streams the loop spent 44% of its
        time in socket writes, and streams arrived in bursts)."""
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await self.q.get()
        if item is _CLIENT_GONE:
            raise _ClientGone()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        while not item.finished and not self.q.empty():
            later = self.q.get_nowait()
            if not isinstance(later, Chunk):  # an error or the client's departure: after this chunk
                self._held = later
                break
            item = merged_chunk(item, later)
        self.num_tokens = item.num_tokens
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.state.inflight -= 1
        if not self.finished:
            self.state.engine_thread.abort(self.rid)


def merged_chunk(first: Chunk, later: Chunk) -> Chunk:
    """Two consecutive chunks of one request as one: the later one's cumulative fields (text, token
    count, finish), both chunks' new tokens and their logprobs."""
    lps = None if first.new_logprobs is None and later.new_logprobs is None else \
        (first.new_logprobs or []) + (later.new_logprobs or [])
    return Chunk(later.text, first.new_token_ids + later.new_token_ids, lps, later.num_tokens, later.prompt_tokens,
                 later.finish_reason, later.stop_reason,
                 first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs)


def _close_all(gens: list[_Generation]) -> None:
    for g in gens:
        g.close()


class _ClosingStreamingResponse(StreamingResponse):
    """Aborts the requests however the response ends (Starlette cancels the body on disconnect)."""

    def __init__(self, content, gens: list[_Generation], **kw):
        super().__init__(content, **kw)
        self._gens = gens

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            _close_all(self._gens)


async def generate(state: ServeState, request: Request, prompts: list[list[int]], params, *, chat: bool,
                   stream: bool, stream_options=None, echo=None, reading=None):
    """echo: a completions request's prepare.Echo, or None; reading: a chat request's
    prepare.ChatReading (its tool calls and thinking), or None."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    include_usage = bool(stream_options and stream_options.include_usage)
    # vLLM's continuous_usage_stats: the usage so far in every chunk
    continuous_usage = bool(stream_options and stream_options.continuous_usage_stats)
    if not state.settings.disable_log_requests:
        log.info("request %s: %d prompt(s) of %s tokens, %s", rid, len(prompts),
                 ",".join(str(len(p)) for p in prompts), params)
    gens = await _submit(state, rid, prompts, params, time.monotonic())
    fmt = Formatter(chat, rid, int(time.time()), state.model_name, state.tokenizer, params.logprobs,
                    params.prompt_logprobs, reading)
    if echo is not None:
        n = params.n
        for g in gens:
            g.echo_text = echo.texts[g.index // n]
        fmt.echo_without_generation = echo.without_generation
        for g in gens:
            g.hides_output = echo.without_generation
    if stream:
        return _ClosingStreamingResponse(_events(gens, fmt, chat, include_usage, continuous_usage), gens,
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return JSONResponse(await _collect(gens, fmt, request))
    except _ClientGone:  # nobody will read this; the engine requests are aborted below
        return Response(status_code=499)
    finally:
        _close_all(gens)


async def _submit(state: ServeState, rid: str, prompts: list[list[int]], params, arrival: float) -> list[_Generation]:
    """Every choice (each sample of each prompt) as an engine request, all submitted before any
    acceptance is awaited, so that the engine takes them in one pass between two steps (one at a
    time, a request of n choices waited about n steps for its first token); all of them or none.
    The queue's room (--max-queue) is judged for the whole request, once."""
    n = params.n
    samples = [child_params(params, j) for j in range(n)] if n > 1 else [params]
    choices = [(i * n + j, ids, p) for i, ids in enumerate(prompts) for j, p in enumerate(samples)]
    engine = state.engine_thread
    limit = engine.max_queue
    if limit is not None and len(choices) > 1:
        if len(choices) > limit:  # waiting before their first step, they could never all be queued
            raise APIError(400, f"This request has {len(choices)} choices (prompts x n), more than the server's "
                                f"waiting queue holds (--max-queue {limit}).", "n" if n > 1 else "prompt",
                           "invalid_value")
        if engine.waiting_estimate() + len(choices) > limit:
            raise QueueFullError(limit)
    names = [rid if len(choices) == 1 else f"{rid}-{index}" for index, _, _ in choices]
    tasks = [asyncio.ensure_future(engine.add(name, ids, p, arrival, len(ids)))
             for name, (_, ids, p) in zip(names, choices)]
    try:
        await asyncio.wait(tasks)
    except BaseException:  # cancelled (the client left): whatever was accepted is aborted
        for name, t in zip(names, tasks):
            if t.done() and not t.cancelled() and t.exception() is None:
                engine.abort(name)
            else:
                t.cancel()  # an acceptance still awaited aborts its request when cancelled
        raise
    refused = [t.exception() for t in tasks if t.exception() is not None]
    if refused:  # e.g. the queue filled up meanwhile: the accepted ones go too
        for name, t in zip(names, tasks):
            if t.exception() is None:
                engine.abort(name)
        raise refused[0]
    return [_Generation(state, name, t.result(), index, ids, counts_prompt=index % n == 0)
            for name, t, (index, ids, _) in zip(names, tasks, choices)]


async def _chunks(gens: list[_Generation]) -> AsyncIterator[tuple[_Generation, Chunk]]:
    """Each generation's chunks as they come; several generations are interleaved."""
    if len(gens) == 1:
        g = gens[0]
        while not g.finished:
            yield g, await g.next()
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(g: _Generation) -> None:
        try:
            while not g.finished:
                merged.put_nowait((g, await g.next()))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer below
            merged.put_nowait((g, e))

    pumps = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        while not all(g.finished for g in gens) or not merged.empty():
            g, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            yield g, item
    finally:
        for p in pumps:
            p.cancel()


async def _events(gens: list[_Generation], fmt: Formatter, chat: bool, include_usage: bool,
                  continuous_usage: bool = False):
    sent = {g.index: "" for g in gens}
    usage_field = include_usage or continuous_usage  # chunks carry "usage" (null unless continuous)

    def so_far(g: _Generation):
        return usage(g.prompt_tokens, 0 if g.hides_output else g.num_tokens) if continuous_usage else None

    try:
        if chat:  # every choice's role first, as vLLM sends them
            for g in gens:
                yield sse(fmt.role_chunk(g.index, usage_field, so_far(g)))
        async for g, c in _chunks(gens):
            prev = sent[g.index]
            delta = c.text[len(prev):] if c.text.startswith(prev) else c.text
            sent[g.index] = c.text
            ids, lps = c.new_token_ids, c.new_logprobs
            if fmt.echo_without_generation:  # the one token made is not returned
                delta, ids, lps = "", [], None if lps is None else []
            if c.prompt_logprobs is not None or (g.echo_text is not None and not fmt.echoed(g.index)):
                delta, ids, lps = fmt.with_prompt(g, c.prompt_logprobs, delta, ids, lps)
            elif not delta and not c.finished and not (lps and ids):
                continue  # nothing visible this step (e.g. a held-back partial stop string)
            body = fmt.chunk(g.index, delta, ids, lps, c.finish_reason, c.stop_reason, usage_field, so_far(g))
            if body is not None:  # None: a tool-call parser holds the text back for now
                yield sse(body)
        if include_usage:
            yield sse(fmt.usage_chunk(_usage(gens)))
    except APIError as e:  # headers are gone already: report in-band, as OpenAI does
        yield sse(error_body(e.status, e.message, e.param, e.code))
    yield SSE_DONE


def _usage(gens: list[_Generation]) -> dict:
    return usage(sum(g.prompt_tokens for g in gens if g.counts_prompt),
                 sum(g.num_tokens for g in gens if not g.hides_output))


async def _watch_disconnect(request: Request, gens: list[_Generation]) -> None:
    # After the body is read, the ASGI server answers receive() only with http.disconnect.
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            for g in gens:
                g.q.put_nowait(_CLIENT_GONE)
            return


async def _collect_one(g: _Generation, fmt: Formatter) -> dict:
    ids: list[int] = []
    lps: list[dict] | None = [] if fmt.wants_logprobs else None
    prompt_lps = None
    while True:
        c = await g.next()
        ids.extend(c.new_token_ids)
        if lps is not None and c.new_logprobs:
            lps.extend(c.new_logprobs)
        if c.prompt_logprobs is not None:
            prompt_lps = c.prompt_logprobs
        if c.finished:
            break
    if c.finish_reason == "abort":
        raise APIError(503, "The request was aborted (the server is shutting down).", code="aborted")
    text = c.text
    if fmt.echo_without_generation:  # the one token made is not returned
        text, ids, lps = "", [], None if lps is None else []
    if prompt_lps is not None or g.echo_text is not None:
        text, ids, lps = fmt.with_prompt(g, prompt_lps, text, ids, lps)
    return fmt.choice(g.index, text, ids, lps, c.finish_reason, c.stop_reason)


async def _collect(gens: list[_Generation], fmt: Formatter, request: Request) -> dict:
    watcher = asyncio.ensure_future(_watch_disconnect(request, gens))
    tasks = [asyncio.ensure_future(_collect_one(g, fmt)) for g in gens]
    try:
        choices = await asyncio.gather(*tasks)
    finally:  # on an error in one choice, the others must not wait on forever
        watcher.cancel()
        for t in tasks:
            t.cancel()
    return fmt.response(list(choices), _usage(gens))
