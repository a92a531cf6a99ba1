"""Tool calling through the server on the fake engine: what tools and tool_choice are checked
against, what reaches the chat template, and the shapes of calls in responses and streams (the
fake writes its fixed pattern whatever the constraint; test_real_engine_tools.py has the real one)."""
from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import FakeEngine, FakeTokenizer, expected_text
from live_server import LiveServer, openai_client

from adaspec.errors import ConfigError
from adaspec.serve.tools import CALL_JSON_STYLE, ToolSettings

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "weather?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _server(**tools):
    return LiveServer(lambda: FakeEngine(max_model_len=1024, max_num_seqs=8, step_delay=0.001), names=("fake",),
                      tools=ToolSettings(**tools))


@pytest.fixture(scope="module")
def plain():
    s = _server()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        yield c
    s.close()


@pytest.fixture(scope="module")
def auto_server():
    s = _server(enable_auto_tool_choice=True, tool_call_parser="hermes", exclude_tools_when_tool_choice_none=True)
    yield s
    s.close()


def _prompt_tokens(messages, tools=None) -> int:
    kwargs = {"tools": tools} if tools is not None else {}
    return len(FakeTokenizer().apply_chat_template(messages, **kwargs))


@pytest.mark.parametrize("body, param, says", [
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": NAMED}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools ('get_weather')"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name", "more than one"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "Missing required parameter"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type", "'function'"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),  # "auto" is the default with tools
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format",
     "cannot also follow response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "cannot also"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
      "tool_choice": "required"}, "tools", "properties must be an object"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
])
def test_a_malformed_tools_request_is_a_400_naming_its_field(plain, body, param, says):
    r = plain.post(CHAT, json={"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize("messages, param, says", [
    ([{"role": "user", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages.0.tool_calls", "Only an assistant message"),
    ([{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages.0.tool_calls.0.function.arguments", "JSON text"),
    ([{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}],
     "messages.0.tool_calls.0.function.arguments", "Missing required parameter"),
])
def test_a_malformed_tool_call_in_a_message_is_a_400_naming_it(plain, messages, param, says):
    r = plain.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"]


def test_response_format_text_asks_for_nothing_beside_a_tool_choice(plain):
    for choice in (NAMED, "required"):
        r = plain.post(CHAT, json={"messages": MSGS, "max_tokens": 3, "tools": [WEATHER], "tool_choice": choice,
                                   "response_format": {"type": "text"}})
        assert r.status_code == 200, r.text


def test_a_conversation_with_calls_and_results_reaches_the_template(plain):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "content": "21C", "tool_call_id": "call_1"}]
    r = plain.post(CHAT, json={"messages": msgs, "max_tokens": 2, "tools": [WEATHER], "tool_choice": "none"})
    assert r.status_code == 200, r.text
    seen = [MSGS[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}]},
        {"role": "tool", "content": "21C", "tool_call_id": "call_1"}]
    assert r.json()["usage"]["prompt_tokens"] == _prompt_tokens(seen, [WEATHER])


def test_tools_reach_the_template_unless_excluded_under_none(plain, auto_server):
    for choice in ("none", None):
        body = {"messages": MSGS, "max_tokens": 2, "tools": [WEATHER]} | ({"tool_choice": choice} if choice else {})
        if choice is None:  # default "auto": only the auto server takes it
            r = httpx.post(auto_server.url + CHAT, json=body, timeout=30)
        else:
            r = plain.post(CHAT, json=body)
        assert r.json()["usage"]["prompt_tokens"] == _prompt_tokens(MSGS, [WEATHER]), r.text
    r = httpx.post(auto_server.url + CHAT, json={"messages": MSGS, "max_tokens": 2, "tools": [WEATHER],
                                                 "tool_choice": "none"}, timeout=30)
    assert r.json()["usage"]["prompt_tokens"] == _prompt_tokens(MSGS)  # --exclude-tools-when-tool-choice-none
    assert plain.post("/tokenize", json={"messages": MSGS, "tools": [WEATHER]}).json()["count"] == \
        _prompt_tokens(MSGS, [WEATHER])


def test_an_empty_tools_list_asks_for_text(plain):
    for choice in ("required", "auto", "none"):
        r = plain.post(CHAT, json={"messages": MSGS, "max_tokens": 5, "tools": [], "tool_choice": choice})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == {"role": "assistant",
                                                     "content": expected_text(_ids(MSGS), 5)}


def _ids(messages, tools=None):
    tok = FakeTokenizer()
    return tok.encode(tok.apply_chat_template(messages, **({"tools": tools} if tools else {})))


def test_a_named_call_carries_the_text_as_its_arguments_streamed_or_not(plain):
    client = openai_client_for(plain)
    r = client.chat.completions.create(model="fake", messages=MSGS, max_tokens=9, tools=[WEATHER], tool_choice=NAMED)
    text = expected_text(_ids(MSGS, [WEATHER]), 9)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "length"
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", text)
    assert call.id.startswith("chatcmpl-tool-")
    chunks = list(client.chat.completions.create(model="fake", messages=MSGS, max_tokens=9, tools=[WEATHER],
                                                 tool_choice=NAMED, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == text
    assert all(not c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_auto_without_calls_in_the_text_is_plain_content(auto_server):
    client = openai_client(auto_server)
    r = client.chat.completions.create(model="fake", messages=MSGS, max_tokens=12, tools=[WEATHER, TIME])
    assert r.choices[0].message.content == expected_text(_ids(MSGS, [WEATHER, TIME]), 12)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="fake", messages=MSGS, max_tokens=12, tools=[WEATHER, TIME],
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_llama3_json_auto_passes_a_reply_that_is_no_call_through():
    s = _server(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    try:
        client = openai_client(s)
        r = client.chat.completions.create(model="fake", messages=MSGS, max_tokens=12, tools=[WEATHER])
        assert r.choices[0].message.content == expected_text(_ids(MSGS, [WEATHER]), 12)
        assert not r.choices[0].message.tool_calls
    finally:
        s.close()


def test_parallel_tool_calls_false_allows_one_call_and_required_asks_for_an_array(plain):
    """The fake ignores the constraint; what the server built from the tools is in the engine's params."""
    from adaspec.serve.protocol import ChatCompletionRequest
    from adaspec.serve.tools import plan_tools

    req = ChatCompletionRequest(messages=MSGS, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    plan = plan_tools(req, ToolSettings())
    schema = plan.structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}  # none declared
    named = plan_tools(ChatCompletionRequest(messages=MSGS, tools=[WEATHER], tool_choice=NAMED), ToolSettings())
    assert named.structured_outputs.json == {**WEATHER["function"]["parameters"], "x-guidance": CALL_JSON_STYLE}
    assert named.name == "get_weather" and schema["x-guidance"] == CALL_JSON_STYLE
    own = {"type": "function", "function": {"name": "f", "parameters": {"x-guidance": {"whitespace_flexible": True}}}}
    loose = plan_tools(ChatCompletionRequest(messages=MSGS, tools=[own], tool_choice="required"), ToolSettings())
    assert loose.structured_outputs.json["x-guidance"] == CALL_JSON_STYLE  # the array's own
    loose = plan_tools(ChatCompletionRequest(messages=MSGS, tools=[own], tool_choice={
        "type": "function", "function": {"name": "f"}}), ToolSettings())
    assert loose.structured_outputs.json["x-guidance"]["whitespace_flexible"] is True  # the schema's say wins
    auto = plan_tools(ChatCompletionRequest(messages=MSGS, tools=[WEATHER], parallel_tool_calls=False),
                      ToolSettings(True, "hermes"))
    assert (auto.mode, auto.max_calls, auto.structured_outputs) == ("auto", 1, None)


def test_required_moves_the_tools_definitions_to_the_root():
    """Pydantic-made tools reference "#/$defs/...": those must resolve in the array's schema."""
    from adaspec.serve.protocol import ChatCompletionRequest
    from adaspec.serve.tools import plan_tools

    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "$defs": defs, "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}}}}}

    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    plan = plan_tools(ChatCompletionRequest(messages=MSGS, tools=[tool("f", {"Place": place}), tool("g", {"Place": place})],
                                            tool_choice="required"), ToolSettings())
    schema = plan.structured_outputs.json
    assert schema["$defs"] == {"Place": place} and all("$defs" not in c["properties"]["parameters"]
                                                       for c in schema["items"]["anyOf"])
    with pytest.raises(Exception, match="define \\$defs/Place differently"):
        plan_tools(ChatCompletionRequest(messages=MSGS, tools=[tool("f", {"Place": place}), tool("g", {"Place": {}})],
                                         tool_choice="required"), ToolSettings())


def test_tool_settings_need_a_parser_for_auto():
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        ToolSettings(enable_auto_tool_choice=True)
    with pytest.raises(ConfigError, match="hermes"):
        ToolSettings(tool_call_parser="mistral")


def test_serve_flags_make_the_tool_settings():
    import argparse

    from adaspec.serve.cli import add_parser, settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                              "--exclude-tools-when-tool-choice-none", "--no-engine-process"])
    assert settings_from_args(args).tools == ToolSettings(True, "hermes", True)
    assert settings_from_args(parser.parse_args(["serve", "m", "--no-engine-process"])).tools == ToolSettings()


def openai_client_for(http: httpx.Client):
    import openai

    return openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="none", max_retries=0, timeout=60)


def test_streamed_tool_chunks_are_json_of_openai_shape(plain):
    with httpx.stream("POST", str(plain.base_url) + CHAT, json={
            "messages": MSGS, "max_tokens": 4, "tools": [WEATHER], "tool_choice": NAMED, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = events[1]["choices"][0]["delta"]  # after the role chunk
    assert set(first) == {"tool_calls"} and set(first["tool_calls"][0]) == {"index", "id", "type", "function"}
