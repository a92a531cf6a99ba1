"""Timed streaming requests against an OpenAI-compatible server (aiohttp), and their schedule.

Times are seconds of an injected clock (`time.perf_counter` by default; tests pass a fake one).
A chunk is timed when the bytes that complete its SSE event arrive (the clock is read once per
completed event, never otherwise while streaming); only chunks that carry `choices` count (the
usage-only chunk does not).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import numpy as np

from adaspec.bench.sse import SSEParser


@dataclass
class RequestSpec:
    prompt: str
    max_tokens: int | None
    temperature: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    status: int | None = None
    prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int = 0  # usage.completion_tokens, or the chunk count when usage is missing
    usage_missing: bool = False  # True: output_tokens counts chunks, not tokens (wrong under speculation)
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    # Tokens each chunk carried, when the server sends cumulative usage in every chunk
    # (vLLM's continuous_usage_stats); None when unknown.
    chunk_tokens: list[int] | None = None
    end_time: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    # The stream ended cleanly after a chunk with a finish_reason but sent no `data: [DONE]`
    # (transformers serve does that); complete, and counted so the result says so.
    without_done: bool = False
    # The stream ended in `data: [DONE]` but no chunk carried a finish_reason: complete (vLLM's
    # client counts any stream that delivered a chunk), and counted so the result says so.
    without_finish_reason: bool = False

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2el(self) -> float | None:
        return self.chunk_times[-1] - self.send_time if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def build_payload(spec: RequestSpec, model: str, endpoint: str, continuous_usage: bool) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": spec.temperature,
    }
    if continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.max_tokens is not None:
        body["max_tokens"] = spec.max_tokens
    if spec.ignore_eos:
        body["ignore_eos"] = True  # vLLM / adaspec extension; OpenAI itself would refuse it
    if spec.seed is not None:
        body["seed"] = spec.seed
    body.update(spec.extra_body)
    return body


# Request fields outside the OpenAI API, and the flag that makes the client send each one.
EXTENSION_FLAGS = {
    "ignore_eos": "--ignore-eos",
    "continuous_usage_stats": "--continuous-usage-stats",
}


def refused_field_hint(status: int, body: str, payload: dict) -> str:
    """For a 4xx whose body names an extension field this payload carried: which flag sent it."""
    if not 400 <= status < 500:
        return ""
    sent = set(payload) | set(payload.get("stream_options") or {})
    named = [f for f in EXTENSION_FLAGS if f in sent and f in body]
    return "".join(f"; the server refused {f}, sent because of {EXTENSION_FLAGS[f]} (run without it)" for f in named)


def _chunk_text(choice: dict, endpoint: str) -> str | None:
    """The chunk's text; None for a chat chunk that only announces the role (no token in it).
    A reasoning model's thinking comes as `delta.reasoning` (vLLM since 2025; `reasoning_content`
    before): such chunks carry tokens too, and are timed as the answer's are."""
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        content = delta.get("content")
        reasoning = delta.get("reasoning")
        if reasoning is None:
            reasoning = delta.get("reasoning_content")
        if content is None and reasoning is None:
            return None if choice.get("finish_reason") is None else ""
        if content == "" and not reasoning and "role" in delta and choice.get("finish_reason") is None:
            return None  # vLLM's first chat chunk: {"role": "assistant", "content": ""}
        return content or reasoning or ""
    return choice.get("text") or ""


Clock = Callable[[], float]


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict,
    endpoint: str,
    headers: dict[str, str] | None = None,
    clock: Clock = time.perf_counter,
) -> RequestResult:
    """One streamed request, timed. Never raises: whatever goes wrong (an HTTP error, a broken or
    odd stream, an error event, a body that is not UTF-8, a usage that is not a number) is this
    request's failure, with its message in `error`, and the run goes on (as vLLM's client)."""
    r = RequestResult()
    try:
        return await _send_request(session, url, payload, endpoint, headers, clock, r)
    except Exception as e:  # noqa: BLE001
        r.success = False
        r.error = r.error or (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        if not r.end_time:
            r.end_time = clock()
        return r


async def _send_request(session, url: str, payload: dict, endpoint: str, headers, clock: Clock,
                        r: RequestResult) -> RequestResult:
    texts: list[str] = []
    cum_tokens: list[int | None] = []  # cumulative completion_tokens seen with each choices chunk
    usage: dict | None = None
    done = False
    r.send_time = clock()
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            r.status = resp.status
            if resp.status != 200:
                # bytes, decoded leniently: an error page need not be UTF-8
                body = (await resp.read()).decode("utf-8", errors="replace")[:300]
                r.error = f"HTTP {resp.status}: {body}" + refused_field_hint(resp.status, body, payload)
                return r
            parser = SSEParser()

            def handle(events: list[str]) -> None:
                nonlocal usage, done
                for ev in events:
                    now = clock()  # per event: a fake clock can tell events of one read apart
                    if ev.strip() == "[DONE]":
                        done = True
                        continue
                    try:
                        data = json.loads(ev)
                    except json.JSONDecodeError:
                        raise RuntimeError(f"malformed SSE data: {ev[:100]!r}") from None
                    if not isinstance(data, dict):
                        raise RuntimeError(f"SSE data is not a JSON object: {ev[:100]!r}")
                    if "error" in data:
                        err = data["error"]
                        raise RuntimeError(f"server error in stream: {err.get('message', err) if isinstance(err, dict) else err}")
                    if data.get("object") == "error":  # older vLLM: {"object": "error", "message": ...}
                        raise RuntimeError(f"server error in stream: {data.get('message', ev[:200])}")
                    if data.get("usage"):
                        usage = data["usage"]
                    choices = data.get("choices") or []
                    if not choices:
                        continue
                    text = _chunk_text(choices[0], endpoint)
                    if choices[0].get("finish_reason"):
                        r.finish_reason = choices[0]["finish_reason"]
                    if text is None:
                        continue
                    r.chunk_times.append(now)
                    texts.append(text)
                    u = data.get("usage") or {}
                    cum_tokens.append(u.get("completion_tokens"))

            async for data in resp.content.iter_any():
                handle(parser.feed(data))
            handle(parser.close())
    except Exception as e:  # noqa: BLE001 - whatever goes wrong in one request fails that request, never the run (as vLLM's client)
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        r.end_time = clock()
        return r
    finally:
        if not r.end_time:
            r.end_time = clock()
    r.text = "".join(texts)
    if not done:
        if r.finish_reason is None:
            # Neither [DONE] nor a finish_reason: the stream was cut short.
            r.error = "stream ended before a finish_reason or data: [DONE]"
            return r
        r.without_done = True  # as vLLM's client: a finished choice ends the stream
    elif r.finish_reason is None:
        r.without_finish_reason = True
    if not r.chunk_times:
        r.error = "stream carried no tokens"
        return r
    if usage and usage.get("completion_tokens") is not None:
        r.output_tokens = int(usage["completion_tokens"])
        r.prompt_tokens = usage.get("prompt_tokens")
    else:
        # Counting chunks undercounts tokens under speculation; flagged so the report can say so.
        r.output_tokens = len(r.chunk_times)
        r.usage_missing = True
    if all(c is not None for c in cum_tokens):
        per = np.diff([0] + cum_tokens).tolist()
        r.chunk_tokens = [int(x) for x in per]
    r.success = True
    return r


def arrival_offsets(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send offsets (s) of n requests: all at 0 for an infinite rate (closed loop), else
    gamma-distributed gaps with mean 1/rate; shape = burstiness (1.0 = Poisson; infinite: every
    gap exactly 1/rate, the gamma's limit, as vLLM)."""
    if not request_rate > 0 or not burstiness > 0:  # NaN included
        raise ValueError(f"request rate and burstiness must be > 0 (inf allowed), got {request_rate} and {burstiness}")
    if request_rate == float("inf"):
        return [0.0] * n
    if burstiness == float("inf"):
        return [i / request_rate for i in range(n)]
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def run_requests(
    url: str,
    payloads: list[dict],
    endpoint: str,
    max_concurrency: int | None,
    offsets: list[float],
    headers: dict[str, str] | None = None,
    timeout_s: float = 6 * 3600,
    on_done: Callable[[RequestResult], None] | None = None,
    clock: Clock = time.perf_counter,
    caps: list[int] | None = None,
    request_ids: list[str] | None = None,
) -> tuple[list[RequestResult], float, float]:
    """Send every payload at its offset with at most `max_concurrency` in flight; with `caps`
    (one per payload: a moving load, see phases.py), in order, each once fewer than its cap are
    in flight (offsets and max_concurrency are not used then).

    Returns the results in payload order, the first send time and the last completion time
    (both on `clock`; the send schedule itself runs on real time). `request_ids`: one per payload,
    sent as its `x-request-id` header (vLLM's --request-id-prefix).
    """

    def headers_of(i: int) -> dict[str, str] | None:
        if request_ids is None:
            return headers
        return {**(headers or {}), "x-request-id": request_ids[i]}

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # limit=0: the connector must never be the hidden concurrency cap.
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def one(i: int, payload: dict, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await send_request(session, url, payload, endpoint, headers_of(i), clock)
            else:
                async with sem:
                    res = await send_request(session, url, payload, endpoint, headers_of(i), clock)
            if on_done:
                on_done(res)
            return res

        if caps is not None:
            from adaspec.bench.phases import run_phased

            async def send_one(i: int) -> RequestResult:
                res = await send_request(session, url, payloads[i], endpoint, headers_of(i), clock)
                if on_done:
                    on_done(res)
                return res

            results = await run_phased(send_one, caps)
        else:
            results = await asyncio.gather(*(one(i, p, o) for i, (p, o) in enumerate(zip(payloads, offsets))))
    first = min((r.send_time for r in results), default=0.0)
    last = max((r.end_time for r in results), default=0.0)
    return list(results), first, last
