"""Random request bodies (known field names, values of any JSON type) never get a 5xx."""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo",
          "ignore_eos", "best_of", "presence_penalty", "logit_bias", "tools", "response_format", "tokens",
          "min_tokens", "min_p", "tool_choice", "chat_template_kwargs", "add_generation_prompt"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=8), st.sampled_from(["fake", "user", "text", "x"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage",
                                                                  "continuous_usage_stats", "name", "tool_calls"]),
                                   inner, max_size=3)),
    max_leaves=8)
# small values that often pass validation, so the engine path gets exercised too
plausible = {"prompt": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.integers(0, 200), max_size=4)),
             "max_tokens": st.integers(-1, 4), "messages": st.lists(st.fixed_dictionaries(
                 {"role": st.sampled_from(["user", "system", "bot"]), "content": st.text(max_size=5)}), max_size=2)}
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries({k: st.one_of(st.just(v), plausible.get(k, st.just(v))) for k, v in d.items()}))


@pytest.fixture(scope="module")
def http(fake_server):
    with httpx.Client(base_url=fake_server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_random_bodies_never_5xx(http, path, body):
    if body.get("stream") is True:
        body["stream"] = False  # keep every response a single JSON body
    r = http.post(path, json=body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
