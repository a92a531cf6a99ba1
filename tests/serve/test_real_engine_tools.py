"""Tool calling on the real engine and the shipped tiny model (its chat template writes tools in
the Hermes convention): named and "required" calls are held to their schemas and equal
LLM.generate's text under the same constraint; "auto" reads <tool_call> blocks out of the text;
streamed and whole responses carry the same calls."""
from __future__ import annotations

import functools
import json

import pytest
from live_server import LiveServer, openai_client

pytest.importorskip("torch")

ENGINE_ARGS = dict(max_num_seqs=8, max_model_len=1024, device="cpu")
MSGS = [{"role": "user", "content": "weather in town?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "city": {"type": "string", "maxLength": 12}},
                   "required": ["unit", "city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine
    from adaspec.serve.tools import ToolSettings

    s = LiveServer(functools.partial(build_engine, EngineConfig(model="tiny", **ENGINE_ARGS)), names=("tiny",),
                   tools=ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def llm():
    from adaspec import LLM

    return LLM("tiny", **ENGINE_ARGS)


def _reference(llm, tools: list[dict], tool_choice, messages=MSGS) -> str:
    """LLM.generate's greedy text for the prompt and constraint the server builds."""
    from adaspec import SamplingParams
    from adaspec.serve.protocol import ChatCompletionRequest
    from adaspec.serve.tools import ToolSettings, plan_tools

    plan = plan_tools(ChatCompletionRequest(messages=messages, tools=tools, tool_choice=tool_choice), ToolSettings())
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=80, structured_outputs=plan.structured_outputs),
                   use_tqdm=False, tools=plan.template_tools)[0]
    return out.outputs[0].text


def _streamed(client, **kw):
    """(content, {index: (id, name, arguments)}, finish_reason) of a streamed chat response."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", messages=MSGS, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.function.name
                calls[d.index] = (d.id, d.function.name, d.function.arguments or "")
            else:
                i, name, args = calls[d.index]
                calls[d.index] = (i, name, args + d.function.arguments)
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_a_named_call_follows_its_schema(client, llm):
    ref = _reference(llm, [WEATHER, TIME], NAMED)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=80, temperature=0,
                                       tools=[WEATHER, TIME], tool_choice=NAMED)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == ref
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    args = json.loads(ref)
    assert set(args) == {"unit", "city"} and args["unit"] in ("c", "f") and len(args["city"]) <= 12
    content, calls, finish = _streamed(client, max_tokens=80, temperature=0, tools=[WEATHER, TIME], tool_choice=NAMED)
    assert (content, [c[1:] for c in calls.values()], finish) == ("", [("get_weather", ref)], "stop")


def test_required_calls_are_an_array_of_the_tools(client, llm):
    ref = json.loads(_reference(llm, [WEATHER, TIME], "required"))
    want = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in ref]
    assert want and all(name in ("get_weather", "get_time") for name, _ in want)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=80, temperature=0,
                                       tools=[WEATHER, TIME], tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == want
    assert len({c.id for c in calls}) == len(calls) and r.choices[0].finish_reason == "tool_calls"
    content, streamed, finish = _streamed(client, max_tokens=80, temperature=0, tools=[WEATHER, TIME],
                                          tool_choice="required")
    assert (content, [c[1:] for c in streamed.values()], finish) == ("", want, "tool_calls")
    one = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=200, temperature=1, seed=3,
                                         tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_auto_reads_the_calls_the_model_writes(client):
    """The model is held (guided_regex) to a reply that calls, with a free city: "auto" is not
    constrained itself, so the regex stands in for a model that calls of its own accord."""
    regex = r'Let me look\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"unit": "c", "city": "[a-z]{1,8}"\}\}\n</tool_call>'
    kw = dict(max_tokens=120, temperature=0, tools=[WEATHER, TIME], extra_body={"guided_regex": regex})
    r = client.chat.completions.create(model="tiny", messages=MSGS, **kw)
    msg = r.choices[0].message
    assert msg.content == "Let me look." and r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "c"
    content, calls, finish = _streamed(client, **kw)
    assert (content, [c[1:] for c in calls.values()], finish) == \
        ("Let me look.", [("get_weather", call.function.arguments)], "tool_calls")
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0, tools=[WEATHER])
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_the_tools_and_earlier_calls_reach_the_prompt_as_llm_chat_writes_it(client, llm):
    from adaspec import SamplingParams

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"unit": "c", "city": "bern"}'}}
    convo = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "21 degrees", "tool_call_id": "call_1"}]
    r = client.chat.completions.create(model="tiny", messages=convo, max_tokens=6, temperature=0, tools=[WEATHER],
                                       tool_choice="none")
    ref = llm.chat(convo, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False, tools=[WEATHER])[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "city": "bern"}}\n</tool_call>' in ref.prompt
    assert "# Tools" in ref.prompt and '"name": "get_weather"' in ref.prompt
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.choices[0].message.content == ref.outputs[0].text
    bare = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, temperature=0)
    assert bare.usage.prompt_tokens < r.usage.prompt_tokens
