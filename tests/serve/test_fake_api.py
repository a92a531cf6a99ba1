"""Server behaviour over the official openai client, against the fake engine (fast, exact)."""
from __future__ import annotations

import itertools
import json
import threading
import time

import httpx
import pytest
from live_server import LiveServer, openai_client
from fake_engine import FakeEngine, FakeTokenizer, expected_text


@pytest.fixture(scope="module")
def client(fake_server):
    return openai_client(fake_server)


def _chat_ids(messages):
    tok = FakeTokenizer()
    return tok.encode(tok.apply_chat_template(messages))


def test_completion_text_usage_and_shape(client):
    r = client.completions.create(model="fake", prompt="hello", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.model == "fake" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected_text(FakeTokenizer().encode("hello"), 10)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 10, 15)


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model="fake", prompt="abc")
    assert r.usage.completion_tokens == 16


def test_token_id_prompt_and_one_element_batch(client):
    ids = FakeTokenizer().encode("hello")
    a = client.completions.create(model="fake", prompt=ids, max_tokens=5)
    b = client.completions.create(model="fake", prompt=["hello"], max_tokens=5)
    assert a.choices[0].text == b.choices[0].text == expected_text(ids, 5)


def test_streamed_completion_concatenates_to_non_streamed(client):
    full = client.completions.create(model="fake", prompt="stream me", max_tokens=20)
    chunks = list(client.completions.create(model="fake", prompt="stream me", max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_completion_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="fake", messages=msgs, max_tokens=7)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    ids = _chat_ids(msgs)
    assert r.choices[0].message.content == expected_text(ids, 7)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 7
    chunks = list(client.chat.completions.create(model="fake", messages=msgs, max_tokens=7, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_content_parts(client):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    r = client.chat.completions.create(model="fake", messages=msgs, max_tokens=3)
    assert r.choices[0].message.content == expected_text(_chat_ids([{"role": "user", "content": "hi"}]), 3)


def test_chat_default_max_tokens_is_rest_of_context(fake_server, client):
    msgs = [{"role": "user", "content": "x"}]
    r = client.chat.completions.create(model="fake", messages=msgs)
    assert r.usage.total_tokens == fake_server.state.max_model_len
    assert r.choices[0].finish_reason == "length"


def test_stop_string_never_leaks_into_stream(client):
    ids = FakeTokenizer().encode("hello")
    text = expected_text(ids, 40)
    stop = text[12:16]  # a 4-char stop string in the middle of the output
    full = client.completions.create(model="fake", prompt="hello", max_tokens=40, stop=[stop])
    assert full.choices[0].text == text[: text.index(stop)]
    assert full.choices[0].finish_reason == "stop" and full.choices[0].stop_reason == stop
    chunks = list(client.completions.create(model="fake", prompt="hello", max_tokens=40, stop=stop, stream=True))
    streamed = ""
    for c in chunks:
        streamed += c.choices[0].text
        assert stop[:2] not in streamed[len(text[: text.index(stop)]):]  # no partial match ever sent
    assert streamed == full.choices[0].text


def test_chunks_end_at_engine_steps_under_speculation():
    """A step's tokens travel together: the prefill step emits 1 token, then 3 per step, so every
    chunk ends after 1, 4, 7 or 10 tokens (steps whose chunks queued up while the event loop was
    busy come merged, serve/generation.py: how many depends on timing, where they end does not)."""
    s = LiveServer(lambda: FakeEngine(tokens_per_step=3), names=("spec",))
    try:
        c = openai_client(s)
        chunks = list(c.completions.create(model="spec", prompt="hi", max_tokens=10, stream=True))
        ends = list(itertools.accumulate(len(ch.choices[0].text) for ch in chunks))
        assert ends[-1] == 10 and set(ends) <= {1, 4, 7, 10} and ends == sorted(set(ends)), ends
    finally:
        s.close()


def test_eos_finishes_with_stop_and_ignore_eos_extension():
    s = LiveServer(lambda: FakeEngine(eos_at=4), names=("eos",))
    try:
        c = openai_client(s)
        r = c.completions.create(model="eos", prompt="hi", max_tokens=10)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 5
        assert len(r.choices[0].text) == 4
        r = c.completions.create(model="eos", prompt="hi", max_tokens=10, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    finally:
        s.close()


def test_completion_logprobs(client):
    r = client.completions.create(model="fake", prompt="hello", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == [-0.25] * 4
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [0, 1, 2, 3]
    chunks = list(client.completions.create(model="fake", prompt="hello", max_tokens=4, logprobs=1, stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 4


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}], max_tokens=3,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob == -0.25 for t in content)


def test_models_health_tokenize(fake_server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake"]
    assert httpx.get(fake_server.url + "/health").status_code == 200
    r = httpx.post(fake_server.url + "/tokenize", json={"prompt": "abc"})
    assert r.json() == {"count": 3, "max_model_len": 256, "tokens": [97, 98, 99]}
    r = httpx.post(fake_server.url + "/tokenize", json={"prompt": "abc", "return_token_strs": True})
    assert r.json()["token_strs"] == ["a", "b", "c"]
    r = httpx.post(fake_server.url + "/detokenize", json={"tokens": [97, 98, 99]})
    assert r.json() == {"prompt": "abc"}


def test_model_may_be_omitted(fake_server):
    r = httpx.post(fake_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "fake"


def test_engine_runs_on_one_thread_only(fake_server):
    ids = fake_server.engine(lambda e: set(e.thread_ids))
    assert len(ids) == 1


def test_null_fields_mean_defaults(fake_server):
    # some clients send every field, unset ones as null
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": None,
            "stream": None, "temperature": None, "top_p": None, "stop": None, "seed": None, "logprobs": None,
            "top_logprobs": None, "presence_penalty": None, "frequency_penalty": None, "logit_bias": None,
            "user": None, "stream_options": None, "tools": None, "response_format": None}
    r = httpx.post(fake_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_batched_prompts_are_choices(client):
    prompts = ["hello", "abc", "zz top"]
    tok = FakeTokenizer()
    r = client.completions.create(model="fake", prompt=prompts, max_tokens=6, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [expected_text(tok.encode(p), 6) for p in prompts]
    assert all(c.logprobs.text_offset == list(range(6)) for c in r.choices)
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts) and r.usage.completion_tokens == 18
    chunks = list(client.completions.create(model="fake", prompt=prompts, max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
        if c.choices[0].finish_reason:
            finished.add(c.choices[0].index)
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices] and finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == 18


def test_chat_stream_logprobs(client):
    chunks = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}],
                                                 max_tokens=3, logprobs=True, top_logprobs=1, stream=True))
    tokens = [t for c in chunks[1:] for t in c.choices[0].logprobs.content]
    assert "".join(t.token for t in tokens) == "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(tokens) == 3 and all(len(t.top_logprobs) == 1 for t in tokens)


def test_engine_failure_mid_stream_is_reported_in_band():
    s = LiveServer(lambda: FakeEngine(fail_on_step=3), names=("fake",))
    try:
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][6:])["error"]
        assert err["code"] == "engine_error" and err["type"] == "internal_server_error"
    finally:
        s.close()


def test_n_samples_are_choices_numbered_prompt_by_prompt(client):
    """n samples of each prompt: choice index = prompt * n + sample, as OpenAI numbers them; the
    usage counts each prompt once (the fake's text depends on the prompt only)."""
    prompts = ["hello", "abc"]
    tok = FakeTokenizer()
    r = client.completions.create(model="fake", prompt=prompts, max_tokens=4, n=3)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [expected_text(tok.encode(p), 4) for p in prompts for _ in range(3)]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len("hello") + len("abc"), 24)
    chunks = list(client.completions.create(model="fake", prompt=prompts, max_tokens=4, n=3, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert [texts[i] for i in range(6)] == [c.text for c in r.choices]
    assert chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_chat_n_streams_a_role_and_content_per_choice(client):
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="fake", messages=messages, max_tokens=3, n=2)
    want = expected_text(_chat_ids(messages), 3)
    assert [(c.index, c.message.content) for c in r.choices] == [(0, want), (1, want)]
    assert r.usage.prompt_tokens == len(_chat_ids(messages)) and r.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="fake", messages=messages, max_tokens=3, n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    content: dict[int, str] = {}
    for c in chunks:
        content[c.choices[0].index] = content.get(c.choices[0].index, "") + (c.choices[0].delta.content or "")
    assert roles == [0, 1] and content == {0: want, 1: want}


def test_the_choices_of_a_request_reach_the_engine_together():
    """All n choices are submitted before any acceptance is awaited, so the engine thread adds
    them between the same two steps (one at a time, the n-th waited ~n steps)."""
    class Recording(FakeEngine):
        def __init__(self):
            super().__init__(max_num_seqs=16, step_delay=0.005)
            self.added_at: list[int] = []

        def add_request(self, *a, **kw):
            self.added_at.append(self.stats.num_steps)
            super().add_request(*a, **kw)

    s = LiveServer(Recording, names=("fake",))
    try:
        busy = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions",
                                                          json={"prompt": "x", "max_tokens": 200}, timeout=60))
        busy.start()  # the engine steps all the while
        deadline = time.monotonic() + 10
        while s.engine(lambda e: e.stats.num_steps) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        r = openai_client(s).completions.create(model="fake", prompt=["ab", "cd"], max_tokens=3, n=4)
        assert len(r.choices) == 8
        at = s.engine(lambda e: list(e.added_at))[1:]  # the busy request's first
        # between one or two pairs of steps (the engine thread may take its inbox while the loop is
        # still putting the choices in, on a loaded machine); one at a time they took eight
        assert len(at) == 8 and len(set(at)) <= 2, at
        busy.join()
    finally:
        s.close()


def test_fields_a_request_leaves_out_take_the_models_recommended_sampling():
    """vLLM's generation_config "auto" in the server: temperature / top_p / top_k a request leaves
    out (or sends as null) come from the model's generation_config.json; given ones stay."""
    class Recommending(FakeEngine):
        sampling_defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}

        def __init__(self):
            super().__init__()
            self.seen = []

        def add_request(self, request_id, prompt, params, arrival_time=None):
            self.seen.append((params.temperature, params.top_p, params.top_k))
            super().add_request(request_id, prompt, params, arrival_time)

    s = LiveServer(Recommending, names=("fake",))
    try:
        c = openai_client(s)
        c.completions.create(model="fake", prompt="x", max_tokens=1)
        c.completions.create(model="fake", prompt="x", max_tokens=1, temperature=0, top_p=1.0)
        c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                  extra_body={"top_k": 5})
        # a greedy request keeps no filter (they cannot change an argmax: vLLM drops them too)
        assert s.engine(lambda e: list(e.seen)) == [(0.6, 0.95, 20), (0.0, 1.0, 0), (0.6, 0.95, 5)]
    finally:
        s.close()


def test_chat_template_keywords_and_the_generation_prompt_reach_the_template(client, fake_server):
    """vLLM's chat extensions: chat_template_kwargs (e.g. Qwen3's enable_thinking) and
    add_generation_prompt go to the template; the keywords adaspec sets itself are refused."""
    msgs = [{"role": "user", "content": "q"}]
    tok = FakeTokenizer()

    def prompt_tokens(**extra):
        r = httpx.post(fake_server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    assert prompt_tokens() == len(tok.apply_chat_template(msgs))
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == \
        len(tok.apply_chat_template(msgs, enable_thinking=False))
    assert prompt_tokens(add_generation_prompt=False) == len(tok.apply_chat_template(msgs, False))
    # continue_final_message: the template asked to end inside the last message (no generation prompt)
    assert prompt_tokens(continue_final_message=True) == \
        len(tok.apply_chat_template(msgs, False, continue_final_message=True))
    for bad, param in (({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                       ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
                       ({"continue_final_message": "yes"}, "continue_final_message")):
        r = httpx.post(fake_server.url + "/v1/chat/completions", json={"messages": msgs, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_keywords_adaspec_sets_are_not_template_keywords():
    from adaspec.errors import InvalidRequestError
    from adaspec.models.registry import resolve_model_path
    from adaspec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    with pytest.raises(InvalidRequestError, match="set by adaspec itself") as e:
        tok.apply_chat_template([{"role": "user", "content": "q"}], bos_token="<s>")
    assert e.value.param == "chat_template_kwargs"


def test_tokenize_reads_messages_as_a_chat_request_does(fake_server):
    msgs = [{"role": "user", "content": "q"}]
    for extra in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        chat = httpx.post(fake_server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **extra})
        tok = httpx.post(fake_server.url + "/tokenize", json={"messages": msgs, **extra})
        assert tok.json()["count"] == chat.json()["usage"]["prompt_tokens"], extra
    r = httpx.post(fake_server.url + "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
