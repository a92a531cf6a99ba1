"""One generation request's life: submit, stream or collect, and abort when the client leaves.

Whatever ends a request early — a client disconnect, a cancelled task, a server drain — goes
through ``_Generation.close``, which aborts it in the engine (freeing its KV blocks) exactly once.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from adaspec.serve.engine_thread import Chunk
from adaspec.serve.errors import APIError, error_body
from adaspec.serve.formatting import SSE_DONE, Formatter, LogprobFormatter, sse, usage
from adaspec.serve.state import ServeState

_CLIENT_GONE = object()


class _ClientGone(Exception):
    pass


class _Generation:
    def __init__(self, state: ServeState, rid: str, q: asyncio.Queue):
        self.state, self.rid, self.q = state, rid, q
        self.finished = False
        self.closed = False
        state.inflight += 1

    async def next(self) -> Chunk:
        item = await self.q.get()
        if item is _CLIENT_GONE:
            raise _ClientGone()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
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


class _ClosingStreamingResponse(StreamingResponse):
    """Aborts the request however the response ends (Starlette cancels the body on disconnect)."""

    def __init__(self, content, gen: _Generation, **kw):
        super().__init__(content, **kw)
        self._gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.close()


async def generate(state: ServeState, request: Request, prompt_ids: list[int], params, *, chat: bool,
                   stream: bool, include_usage: bool):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    arrival = time.monotonic()
    q = await state.engine_thread.add(rid, prompt_ids, params, arrival, len(prompt_ids))
    gen = _Generation(state, rid, q)
    lp = LogprobFormatter(state.tokenizer, params.logprobs) if params.logprobs is not None else None
    fmt = Formatter(chat, rid, int(time.time()), state.model_name, lp)
    if stream:
        return _ClosingStreamingResponse(_events(gen, fmt, chat, include_usage, len(prompt_ids)), gen,
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return JSONResponse(await _collect(gen, fmt, request, len(prompt_ids)))
    except _ClientGone:  # nobody will read this; the engine request is aborted below
        return Response(status_code=499)
    finally:
        gen.close()


async def _events(gen: _Generation, fmt: Formatter, chat: bool, include_usage: bool, n_prompt: int):
    sent = ""
    n_tokens = 0
    try:
        if chat:
            yield sse(fmt.role_chunk(include_usage))
        while not gen.finished:
            c = await gen.next()
            delta = c.text[len(sent):] if c.text.startswith(sent) else c.text
            sent, n_tokens = c.text, c.num_tokens
            if not delta and not c.finished and not (c.new_logprobs and c.new_token_ids):
                continue  # nothing visible this step (e.g. a held-back partial stop string)
            yield sse(fmt.chunk(delta, c.new_token_ids, c.new_logprobs, c.finish_reason, c.stop_reason,
                                include_usage))
        if include_usage:
            yield sse(fmt.usage_chunk(usage(n_prompt, n_tokens)))
    except APIError as e:  # headers are gone already: report in-band, as OpenAI does
        yield sse(error_body(e.status, e.message, e.param, e.code))
    yield SSE_DONE


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    # After the body is read, the ASGI server answers receive() only with http.disconnect.
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            q.put_nowait(_CLIENT_GONE)
            return


async def _collect(gen: _Generation, fmt: Formatter, request: Request, n_prompt: int) -> dict:
    watcher = asyncio.ensure_future(_watch_disconnect(request, gen.q))
    ids: list[int] = []
    lps: list[dict] | None = [] if fmt.lp is not None else None
    try:
        while True:
            c = await gen.next()
            ids.extend(c.new_token_ids)
            if lps is not None and c.new_logprobs:
                lps.extend(c.new_logprobs)
            if c.finished:
                break
    finally:
        watcher.cancel()
    if c.finish_reason == "abort":
        raise APIError(503, "The request was aborted (the server is shutting down).", code="aborted")
    return fmt.response(c.text, ids, lps, c.finish_reason, c.stop_reason, usage(n_prompt, c.num_tokens))
