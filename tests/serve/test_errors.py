"""Every error leaves with its status and an OpenAI-format body; no malformed body gets a 500."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from live_server import LiveServer, openai_client
from fake_engine import FakeEngine

C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _assert_openai_error(r: httpx.Response, status: int, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err


# (path, body, expected status, expected param)
ERROR_CASES = [
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": ["x", "y"], "n": 129}, 400, "n"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "seed": 1.5}, 400, "seed"),
    (C, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "x", "echo": True, "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    (C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # "²".isdigit(), but no int
    (C, {"prompt": "x", "logit_bias": {"1114112": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "allowed_token_ids": [-2]}, 400, "allowed_token_ids"),
    (C, {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    (C, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ["a", "x" * 300]}, 400, "prompt"),  # one prompt of a batch too long
    (C, {"prompt": ["a"] * 257}, 400, "prompt"),
    (C, {"prompt": [-1]}, 400, "prompt"),
    (C, {"prompt": "x" * 300}, 400, "prompt"),  # longer than max_model_len 256
    (C, {"prompt": "x" * 250, "max_tokens": 10}, 400, "max_tokens"),
    (C, {}, 400, "prompt"),
    (C, {"model": "nope", "prompt": "x"}, 404, "model"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, None),
    (CH, {"messages": MSG, "logprobs": 3}, 400, "logprobs"),
    (CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CH, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CH, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (CH, {"messages": MSG, "n": 257}, 400, "n"),
    (CH, {"messages": MSG, "n": 1.5}, 400, "n"),
    (CH, {"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
    (CH, {"model": "nope", "messages": MSG}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, None),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", ERROR_CASES, ids=lambda v: json.dumps(v)[:60])
def test_error_cases(fake_server, path, body, status, param):
    _assert_openai_error(httpx.post(fake_server.url + path, json=body), status, param)


MALFORMED = [
    b"", b"{", b"}", b"null", b"[]", b"42", b'"str"', b"\xff\xfe", b'{"prompt": NaN}', b'{"prompt": "x",}',
    b'{"prompt": 5}', b'{"prompt": {"a": 1}}', b'{"prompt": [[1], [2]]}', b'{"prompt": [1.5]}',
    b'{"prompt": [true]}', b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": "x", "max_tokens": 99999999999999999999999}',
    b'{"prompt": "x", "temperature": 1e400}', b'{"prompt": "x", "stop": 7}', b'{"prompt": "x", "stop": [1]}',
    b'{"prompt": "x", "stream_options": 1}', b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": "y"}}',
    b'{"prompt": "x", "logprobs": true}', b'{"prompt": "x", "seed": -1}', b'{"prompt": "x", "seed": 99999999999999999999999}',
    b'{"prompt": "x", "stop_token_ids": [-3]}', b'{"prompt": "x", "logit_bias": {"1": 5}}', b'{"prompt": "x", "model": 5}',
    b'{"messages": null}', b'{"messages": "hi"}', b'{"messages": [null]}', b'{"messages": [{"content": "x"}]}',
    b'{"messages": [{"role": "user", "content": 5}]}', b'{"messages": [{"role": "user"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}',
    b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1, "logprobs": true}',
    b'{"prompt": "\\ud800"}', b'{"prompt": [1114112]}', b'{"tokens": [-1]}', b'{"tokens": [99999999999]}',
]


@pytest.mark.parametrize("body", MALFORMED, ids=lambda b: repr(b)[:40])
@pytest.mark.parametrize("path", [C, CH, "/tokenize", "/detokenize"])
def test_malformed_bodies_never_500(fake_server, path, body):
    r = httpx.post(fake_server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        _assert_openai_error(r, r.status_code)


def test_unknown_route_and_method_are_openai_errors(fake_server):
    _assert_openai_error(httpx.get(fake_server.url + "/v1/nothing"), 404)
    _assert_openai_error(httpx.get(fake_server.url + C), 405)


def test_openai_client_raises_typed_errors(fake_server):
    c = openai_client(fake_server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="fake", prompt="x", n=0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="x")


V1_ROUTES = [("GET", "/v1/models", None), ("POST", C, {"prompt": "x", "max_tokens": 1}),
             ("POST", CH, {"messages": MSG, "max_tokens": 1}), ("GET", "/v1/unknown", None)]


def test_api_key_guards_every_v1_route():
    s = LiveServer(lambda: FakeEngine(), names=("fake",), api_key="sekret")
    try:
        for method, path, body in V1_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
                r = httpx.request(method, s.url + path, json=body, headers=headers)
                _assert_openai_error(r, 401)
                assert r.json()["error"]["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer sekret"}
        assert httpx.get(s.url + "/v1/models", headers=ok).status_code == 200
        assert httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 1}, headers=ok).status_code == 200
        assert httpx.get(s.url + "/health").status_code == 200  # probes need no key, as in vLLM
        with pytest.raises(openai.AuthenticationError):
            openai_client(s, key="wrong").models.list()
        assert openai_client(s, key="sekret").models.list().data[0].id == "fake"
    finally:
        s.close()


def test_queue_full_is_503_with_retry_after():
    # one running slot and room for 2 waiting: with 1 running and 2 waiting, the next is refused
    s = LiveServer(lambda: FakeEngine(max_num_seqs=1, step_delay=0.02), names=("fake",), max_queue=2)
    try:
        results = []

        def long_request():
            r = httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 30}, timeout=30)
            results.append(r.status_code)

        def wait_for(pred):
            deadline = time.monotonic() + 10
            while not pred() and time.monotonic() < deadline:
                time.sleep(0.005)
            assert pred()

        threads = [threading.Thread(target=long_request) for _ in range(3)]
        threads[0].start()
        wait_for(lambda: s.engine(lambda e: e.num_running()) == 1)
        for t in threads[1:]:
            t.start()
        wait_for(lambda: s.engine_thread.waiting_estimate() == 2)
        r = httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 1})
        _assert_openai_error(r, 503)
        assert r.headers["Retry-After"] == "1"
        for t in threads:
            t.join()
        assert results == [200, 200, 200]
        assert httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 1}).status_code == 200
    finally:
        s.close()


def test_engine_failure_is_500_then_the_server_exits_nonzero():
    # An engine whose step failed is dead: the server stops (exit 1, as vLLM) so a supervisor
    # restarts it, instead of staying up answering 503 forever.
    s = LiveServer(lambda: FakeEngine(fail_on_step=3), names=("fake",))
    try:
        r = httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 10})
        _assert_openai_error(r, 500)
        s._thread.join(30)
        assert not s._thread.is_alive()
        assert s.server.exit_code == 1
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health")
    finally:
        s.close()


def test_an_engine_fault_outside_the_step_also_exits_instead_of_lingering():
    # Before, an exception in the thread's bookkeeping ended the thread silently: /health then
    # answered 503 forever while the process stayed up.
    class FaultyCounts(FakeEngine):
        def num_waiting(self):
            if self.waiting:
                raise RuntimeError("counting failed")
            return 0

    s = LiveServer(lambda: FaultyCounts(), names=("fake",))
    try:
        _assert_openai_error(httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 3}), 500)
        s._thread.join(30)
        assert not s._thread.is_alive() and s.server.exit_code == 1
    finally:
        s.close()


def test_a_request_of_several_choices_is_queued_whole_or_refused_whole():
    """--max-queue judges all of a request's choices at once: more than the queue holds is a 400
    naming n (it could never be queued), more than its free room a 503, and nothing of a refused
    request reaches the engine."""
    class Recording(FakeEngine):
        def __init__(self):
            super().__init__(max_num_seqs=1, step_delay=0.01)  # the holder's 200 steps: >= 2 s each
            self.added: list[str] = []

        def add_request(self, request_id, *a, **kw):
            self.added.append(request_id)
            super().add_request(request_id, *a, **kw)

    s = LiveServer(Recording, names=("fake",), max_queue=4)
    try:
        r = httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 2, "n": 5})
        _assert_openai_error(r, 400, "n")
        r = httpx.post(s.url + C, json={"prompt": ["x", "y", "z"], "max_tokens": 2, "n": 2})
        _assert_openai_error(r, 400, "n")
        r = httpx.post(s.url + C, json={"prompt": ["x"] * 5, "max_tokens": 2})
        _assert_openai_error(r, 400, "prompt")
        assert s.engine(lambda e: list(e.added)) == []
        holder = threading.Thread(target=lambda: httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 200,
                                                                             "n": 2}, timeout=30))
        holder.start()  # one running, one waiting: room for 3 more
        deadline = time.monotonic() + 10
        while s.engine_thread.waiting_estimate() != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        r = httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 1, "n": 4})
        _assert_openai_error(r, 503)
        assert len(s.engine(lambda e: list(e.added))) == 2  # the holder's two choices only
        assert httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 1, "n": 3}).status_code == 200
        holder.join()
    finally:
        s.close()


def test_a_choice_the_engine_refuses_takes_the_accepted_ones_back():
    from adaspec.errors import InvalidRequestError

    class RefusesTheSecond(FakeEngine):
        def add_request(self, request_id, *a, **kw):
            if request_id.endswith("-1"):
                raise InvalidRequestError("not this one", param="prompt")
            super().add_request(request_id, *a, **kw)

    s = LiveServer(lambda: RefusesTheSecond(step_delay=0.05), names=("fake",))
    try:  # left running, choices 0 and 2 would take 200 steps of 50 ms
        r = httpx.post(s.url + C, json={"prompt": "x", "max_tokens": 200, "n": 3})
        _assert_openai_error(r, 400, "prompt")
        deadline = time.monotonic() + 5
        while s.engine(lambda e: e.has_unfinished_requests()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not s.engine(lambda e: e.has_unfinished_requests())  # choices 0 and 2 were aborted
        assert s.state.inflight == 0
    finally:
        s.close()
