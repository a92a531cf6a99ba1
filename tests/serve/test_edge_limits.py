"""What a request costs is bounded before the work is done (issue 11): JSON only, a body-size
cap, texts that cannot fit refused before they are tokenized, a large body tokenized off the
event loop, and /tokenize behind the API key."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from live_server import LiveServer
from fake_engine import FakeEngine, FakeTokenizer

from adaspec.serve.app import INLINE_BODY_BYTES

C = "/v1/completions"


def _err(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def small_body_server():
    s = LiveServer(lambda: FakeEngine(max_model_len=64), names=("fake",), max_request_body_bytes=1000,
                   api_key="sekrit")
    yield s
    s.close()


AUTH = {"Authorization": "Bearer sekrit"}


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
@pytest.mark.parametrize("path", [C, "/v1/chat/completions", "/tokenize"])
def test_a_body_that_is_not_declared_json_is_415(small_body_server, path, ctype):
    headers = dict(AUTH)
    if ctype is not None:
        headers["Content-Type"] = ctype
    body = b'{"prompt": "x", "max_tokens": 2, "top_k": 9223372036854775808}'
    r = httpx.post(small_body_server.url + path, content=body, headers=headers)
    _err(r, 415, "unsupported_media_type")


def test_json_with_a_charset_is_accepted(small_body_server):
    r = httpx.post(small_body_server.url + C, content=b'{"prompt": "x", "max_tokens": 2}',
                   headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_a_body_over_the_limit_is_413_from_its_content_length(small_body_server):
    r = httpx.post(small_body_server.url + C, json={"prompt": "x" * 2000, "max_tokens": 2}, headers=AUTH)
    _err(r, 413, "request_too_large")
    assert httpx.get(small_body_server.url + "/health").status_code == 200


def test_a_chunked_body_over_the_limit_is_413(small_body_server):
    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"x" * 100
        yield b'", "max_tokens": 2}'

    r = httpx.post(small_body_server.url + C, content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"})
    _err(r, 413, "request_too_large")
    r = httpx.post(small_body_server.url + C, json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [65]})])
def test_tokenize_needs_the_api_key(small_body_server, path, body):
    _err(httpx.post(small_body_server.url + path, json=body), 401, "invalid_api_key")
    assert httpx.post(small_body_server.url + path, json=body, headers=AUTH).status_code == 200


class _RecordingTokenizer(FakeTokenizer):
    """Records what it was asked to encode; ``gate``, when set, holds encode until released."""

    def __init__(self):
        self.encoded: list[int] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def encode(self, text, add_special_tokens=False):
        self.encoded.append(len(text))
        if self.gate is not None:
            self.entered.set()
            assert self.gate.wait(60)
        return super().encode(text)


@pytest.fixture
def recording():
    tok = _RecordingTokenizer()

    def factory():
        e = FakeEngine(max_model_len=64)
        e.tokenizer = tok
        return e

    s = LiveServer(factory, names=("fake",))
    yield s, tok
    s.close()


@pytest.mark.parametrize("path, body", [
    (C, {"prompt": "y" * 100_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 100_000}]}),
    ("/tokenize", {"prompt": "y" * 100_000}),
])
def test_a_text_that_cannot_fit_is_refused_without_tokenizing_it(recording, path, body):
    s, tok = recording
    err = _err(httpx.post(s.url + path, json=body), 400, "context_length_exceeded")
    assert "64 tokens" in err["message"]
    assert all(n < 1000 for n in tok.encoded), tok.encoded  # the long text never reached encode
    # the bound is exact for one character per token: 63 characters fit, 64 do not
    assert httpx.post(s.url + C, json={"prompt": "y" * 63, "max_tokens": 1}).status_code == 200
    assert httpx.post(s.url + "/tokenize", json={"prompt": "y" * 64}).status_code == 200  # (tokenize has no limit)


@pytest.mark.parametrize("path, body", [
    (C, {"prompt": "y" * 100_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 100_000}]}),
])
def test_a_text_truncate_prompt_tokens_cuts_is_not_refused_for_its_length(recording, path, body):
    """vLLM truncates first, then checks the length: the text bound (no tokenization could fit)
    must not refuse a prompt that truncate_prompt_tokens will cut to fit (it did, with a 400)."""
    s, tok = recording
    r = httpx.post(s.url + path, json={**body, "max_tokens": 2, "truncate_prompt_tokens": 20}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 20


def test_tokenizing_a_large_body_does_not_block_the_event_loop(recording):
    s, tok = recording
    tok.gate = threading.Event()
    result = {}
    t = threading.Thread(target=lambda: result.update(
        r=httpx.post(s.url + C, content=_padded({"prompt": "slow", "max_tokens": 2}, INLINE_BODY_BYTES + 1),
                     headers=JSON, timeout=60)))
    t.start()
    try:
        assert tok.entered.wait(30)  # the request is inside encode now...
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200  # ...and the server answers
        assert not tok.gate.is_set()
    finally:
        tok.gate.set()
        t.join(60)
    assert result["r"].status_code == 200


JSON = {"Content-Type": "application/json"}


def _padded(body: dict, size: int) -> bytes:
    """``body`` as JSON of at least ``size`` bytes (white space after it): a large body, a short prompt."""
    raw = json.dumps(body).encode()
    return raw + b" " * max(0, size - len(raw))


@pytest.mark.parametrize("size, hops", [(100, 0), (INLINE_BODY_BYTES + 1, 2)])
def test_only_a_large_body_goes_to_a_worker_thread(recording, monkeypatch, size, hops):
    """A small body is parsed and tokenized on the event loop (the hop to a thread cost the loop
    more than the work, and the HF tokenizer holds the GIL anyway); a large one in a thread, twice
    (parse, then tokenize)."""
    import adaspec.serve.app as app_module

    s, tok = recording
    calls = []
    real = app_module.run_in_threadpool

    async def counting(fn, *args):
        calls.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(app_module, "run_in_threadpool", counting)
    r = httpx.post(s.url + C, content=_padded({"prompt": "yy", "max_tokens": 2}, size), headers=JSON, timeout=60)
    assert r.status_code == 200, r.text
    assert tok.encoded == [2] and len(calls) == hops, calls


def test_a_client_that_leaves_mid_body_is_no_internal_error(caplog):
    """A client that closes its connection before the whole body arrived is logged as such, once,
    not as an internal error with tracebacks (any client could flood the error log so)."""
    import logging
    import socket
    import time

    s = LiveServer(lambda: FakeEngine(), names=("fake",))
    try:
        with caplog.at_level(logging.INFO):
            host, port = s.url.split("//")[1].split(":")
            sock = socket.create_connection((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\":")
            sock.close()  # after the headers and part of the body: the app is reading the rest
            deadline = time.monotonic() + 30  # a bound on a hang only
            while not any("went away" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert httpx.get(s.url + "/health").status_code == 200
        assert any("went away" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    finally:
        s.close()
