"""An in-process fake OpenAI-compatible server with scripted streams, for the bench tests.

The prompt names its script ("s:NAME"); each script lists chunks as (delay_s, text, n_tokens).
It runs an aiohttp app in its own thread and event loop, so tests can call asyncio.run freely.
With a FakeClock the delays are virtual (see fakeclock.py): no test waits or depends on timing.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Script:
    chunks: list = field(default_factory=list)  # (delay_s, text, n_tokens)
    status: int = 200
    usage: bool = True
    prompt_tokens: int = 4
    done: bool = True  # False: the stream ends cleanly but without data: [DONE]
    finish: bool = True  # False: no chunk carries a finish_reason
    cut_after: int | None = None  # close the TCP connection after this many chunks
    counts_spec: bool = True
    refuse: tuple = ()  # request fields answered with 422, as transformers serve does
    # The first hold_first requests of this script wait (before streaming) until that many
    # requests are open on the server at once: a run that should reach a concurrency of
    # hold_first provably does, whatever the timing. Gives up after a real-time safety bound and
    # marks the server `stalled` (a test then fails on it, never hangs).
    hold_first: int = 0


# Counters one streamed request adds to /metrics (hand-checkable in tests).
SPEC_PER_REQUEST = {"drafts": 2, "draft_tokens": 14, "accepted_tokens": 5, "verified_tokens": 16}
SPEC_PER_POS = [2, 2, 1, 0, 0, 0, 0]


class FakeServer:
    def __init__(self, scripts: dict[str, Script], prefix: str = "adaspec:", metrics: bool = True,
                 default: Script | None = None, port: int = 0, clock=None):
        self.scripts = scripts
        self.default = default
        self.prefix = prefix
        self.metrics = metrics
        self.clock = clock  # a FakeClock: advance it instead of sleeping
        self.counters = {k: 0 for k in SPEC_PER_REQUEST}
        self.per_pos = [0] * len(SPEC_PER_POS)
        self.requests: list[dict] = []
        self.open = 0  # requests being answered now
        self.stalled = False
        self._held: dict[int, int] = {}  # id(script) -> how many of its requests were held so far
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = port

    # -- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> "FakeServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if self.metrics:
            app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    # -- handlers -------------------------------------------------------------------
    async def _health(self, request):
        return web.Response(text="ok")

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _metrics(self, request):
        p = self.prefix
        lines = [f"# TYPE {p}num_requests_running gauge", f'{p}num_requests_running{{model_name="m"}} 0.0']
        for k, v in self.counters.items():
            lines += [f"# TYPE {p}spec_decode_num_{k} counter", f'{p}spec_decode_num_{k}_total{{model_name="m"}} {float(v)}']
        lines.append(f"# TYPE {p}spec_decode_num_accepted_tokens_per_pos counter")
        for i, v in enumerate(self.per_pos):
            lines.append(f'{p}spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {float(v)}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _completions(self, request):
        self.open += 1
        try:
            return await self._answer(request)
        finally:
            self.open -= 1

    async def _hold(self, sc: Script) -> None:
        if self._held.get(id(sc), 0) >= sc.hold_first:
            return
        self._held[id(sc)] = self._held.get(id(sc), 0) + 1
        give_up = time.monotonic() + 10.0
        while self.open < sc.hold_first and not self.stalled:
            if time.monotonic() > give_up:
                self.stalled = True
                return
            await asyncio.sleep(0.001)

    async def _answer(self, request):
        body = await request.json()
        self.requests.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        sc = self.scripts.get(prompt[2:] if prompt.startswith("s:") else prompt, self.default)
        if sc is None:
            return web.json_response({"error": {"message": f"no script {prompt!r}"}}, status=400)
        unexpected = {f for f in sc.refuse if f in body}
        if unexpected:  # transformers serve's wording
            return web.json_response({"detail": f"Unexpected fields in the request: {unexpected}"}, status=422)
        if sc.status != 200:
            return web.json_response({"error": {"message": "scripted failure", "type": "server_error"}}, status=sc.status)
        if sc.hold_first:
            await self._hold(sc)
        if sc.counts_spec:
            for k, v in SPEC_PER_REQUEST.items():
                self.counters[k] += v
            for i, v in enumerate(SPEC_PER_POS):
                self.per_pos[i] += v
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        opts = body.get("stream_options") or {}
        cont = opts.get("continuous_usage_stats")
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def write(data: bytes) -> None:
            seen = self.clock.reads if self.clock else 0
            await resp.write(data)
            if self.clock:  # the client stamps this event before the clock moves on
                await self.clock.wait_read_after(seen)

        async def send(obj) -> None:
            await write(f"data: {json.dumps(obj)}\n\n".encode())

        async def pause(delay: float) -> None:
            if self.clock:
                self.clock.advance(delay)
            else:
                await asyncio.sleep(delay)

        if chat:  # vLLM announces the role first; that chunk carries no token
            await send({"object": kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        total = 0
        for i, (delay, text, ntok) in enumerate(sc.chunks):
            await pause(delay)
            if sc.cut_after is not None and i >= sc.cut_after:
                request.transport.close()  # abrupt: the client sees a broken chunked body
                return resp
            total += ntok
            last = i == len(sc.chunks) - 1
            choice = {"index": 0, "finish_reason": "length" if last and sc.finish else None}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            obj = {"object": kind, "choices": [choice]}
            if cont:
                obj["usage"] = {"prompt_tokens": sc.prompt_tokens, "completion_tokens": total,
                                "total_tokens": sc.prompt_tokens + total}
            await send(obj)
        if sc.usage and opts.get("include_usage"):
            await send({"object": kind, "choices": [], "usage": {
                "prompt_tokens": sc.prompt_tokens, "completion_tokens": total, "total_tokens": sc.prompt_tokens + total}})
        if sc.done:
            await write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
