"""The tool-call parsers (serve/tool_parsers.py): what they read out of a text, and that a
streamed text, however it is cut, gives what the whole text gives."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from adaspec.serve.tool_parsers import (HermesCalls, JsonCalls, Llama3JsonCalls, NamedCall, Parsed, PythonicCalls,
                                        merge_calls)


def parse(parser, pieces) -> tuple[str, list[tuple[str, str]], list[Parsed]]:
    """-> (content, [(name, arguments)], the Parsed of each feed and of finish)."""
    steps = [parser.feed(p) for p in pieces] + [parser.finish()]
    total = Parsed()
    for s in steps:
        total += s
    return total.content, [(c["function"]["name"], c["function"]["arguments"]) for c in merge_calls(total.calls)], steps


def cuts(text: str, positions: list[int]) -> list[str]:
    at = sorted({p % (len(text) + 1) for p in positions})
    return [text[a:b] for a, b in zip([0] + at, at + [len(text)])]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "a}b"}}\n</tool_call>'
HERMES_PARTS = st.sampled_from([
    "Sure.", " ", "\n", "let me check", CALL, '<tool_call>{"name": "f"}</tool_call>',
    "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "<tool", "<tool_call",
    "</tool_call>", "<", "{", '"}', "é",
])


def test_hermes_calls_content_and_whitespace():
    text = "Sure. " + CALL + "\n" + '<tool_call>{"name": "f"}</tool_call>' + "\n\nDone."
    content, calls, _ = parse(HermesCalls(), [text])
    assert calls == [("get_weather", '{"city": "Zürich", "note": "a}b"}'), ("f", "{}")]
    assert content == "Sure.\n\nDone."  # the whitespace next to the calls goes, not the one parting content
    assert parse(HermesCalls(), [CALL + "\n"])[:2] == ("", [calls[0]])


def test_hermes_keeps_what_is_not_a_call_as_written():
    text = 'a <tool_call>not json</tool_call> b <tool_call>{"name": 3}</tool_call>'
    assert parse(HermesCalls(), [text])[:2] == (text, [])


def test_hermes_a_block_the_text_ends_in_is_a_call_if_its_json_is_whole():
    assert parse(HermesCalls(), ['<tool_call>{"name": "f", "arguments": {"x": 1}}'])[:2] == ("", [("f", '{"x": 1}')])
    cut = '<tool_call>{"name": "f", "argu'
    assert parse(HermesCalls(), [cut])[:2] == (cut, [])


def test_hermes_after_max_calls_blocks_are_content():
    two = CALL + CALL
    content, calls, _ = parse(HermesCalls(max_calls=1), [two])
    assert len(calls) == 1 and content == CALL


def test_hermes_holds_back_only_what_may_start_a_call():
    p = HermesCalls()
    assert p.feed("Hi there <tool").content == "Hi there"
    assert p.feed("box> and").content == " <toolbox> and"
    assert p.feed(" ").content == ""
    assert p.finish().content == " "


def test_hermes_streams_a_call_when_its_block_closes():
    p = HermesCalls()
    assert p.feed(CALL[:-3]).calls == []
    (call,) = p.feed(CALL[-3:]).calls
    assert call.index == 0 and call.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert call.to_json() == {"index": 0, "id": call.id, "type": "function",
                              "function": {"name": "get_weather", "arguments": call.arguments}}


ELEMENTS = [{"name": "f", "parameters": {"s": "}]{,"}}, {"name": "g", "parameters": {}},
            {"name": "h", "parameters": {"n": [1, {"k": None}]}}]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(ELEMENTS), min_size=1, max_size=3), st.sampled_from(["", " ", "\n  "]),
       st.lists(st.integers(0, 10_000), max_size=12), st.integers(0, 200))
def test_required_reads_each_element_once_complete_however_cut(elements, ws, positions, cut_at):
    text = "[" + ws + ("," + ws).join(json.dumps(e, ensure_ascii=False) for e in elements) + ws + "]"
    want = [(e["name"], json.dumps(e["parameters"], ensure_ascii=False)) for e in elements]
    assert parse(JsonCalls(), cuts(text, positions))[:2] == ("", want)
    short = text[:cut_at % len(text)]  # cut short (max_tokens): the complete elements, the rest content
    content, calls, _ = parse(JsonCalls(), cuts(short, positions))
    assert calls == want[:len(calls)]
    assert parse(JsonCalls(), [short])[:2] == (content, calls)
    assert content.strip() == "" or short.endswith(content)
    if not calls:  # cut before any call closed: the text exactly (its "[" was dropped)
        assert content == short


def test_required_streams_a_call_the_moment_it_closes():
    text = json.dumps([ELEMENTS[0], ELEMENTS[1]])
    close = text.index("}}") + 2
    p = JsonCalls()
    assert p.feed(text[:close - 1]).calls == []
    assert [c.name for c in p.feed(text[close - 1:close]).calls] == ["f"]
    assert [c.name for c in p.feed(text[close:]).calls] == ["g"]
    assert p.finish() == Parsed()


def test_required_text_that_is_not_the_array_is_content():
    assert parse(JsonCalls(), ['{"name": "f"}'])[:2] == ('{"name": "f"}', [])
    assert parse(JsonCalls(), ['[{"name": "f", "parameters": 1}]'])[:2] == ('[{"name": "f", "parameters": 1}]', [])
    assert parse(Llama3JsonCalls(), [' <|python_tag|>{"name": "f", ', '"par'])[:2] == (
        ' <|python_tag|>{"name": "f", "par', [])  # no call: the text exactly, its tag too


def test_named_call_streams_its_arguments():
    p = NamedCall("f")
    first = p.feed('{"a"')
    later = p.feed(": 1}")
    assert first.calls[0].name == "f" and first.calls[0].id and first.calls[0].arguments == '{"a"'
    assert later.calls[0].to_json() == {"index": 0, "function": {"arguments": ": 1}"}}
    assert p.finish() == Parsed()
    assert merge_calls(first.calls + later.calls)[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_named_call_with_no_text_is_still_a_call():
    assert parse(NamedCall("f"), [""])[:2] == ("", [("f", "")])


LLAMA_PARTS = st.sampled_from([
    '{"name": "f", "parameters": {"a": "x;}"}}', '{"name": "g", "arguments": {}}', "; ", ";", " ", "\n",
    "<|python_tag|>", "<|python", "Sure", "{", '{"name": 1}', "é",
])


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": "é"}}'
    assert parse(Llama3JsonCalls(), [text])[:2] == ("", [("f", '{"a": 1}'), ("g", '{"b": "é"}')])
    assert parse(Llama3JsonCalls(), [' {"name": "f", "parameters": {}}\n'])[:2] == ("", [("f", "{}")])
    assert parse(Llama3JsonCalls(), ["The answer is {x}."])[:2] == ("The answer is {x}.", [])
    p = Llama3JsonCalls()
    assert p.feed("<|py").content == "" and p.feed("x").content == "<|pyx"  # not the tag after all
    cut = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "par'
    assert parse(Llama3JsonCalls(), [cut])[:2] == ('{"name": "g", "par', [("f", '{"a": 1}')])
    two = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'
    assert parse(Llama3JsonCalls(max_calls=1), [two])[:2] == ('{"name": "g", "parameters": {}}', [("f", "{}")])


PYTHONIC_PARTS = st.sampled_from([
    "[", "]", "f(a=1)", 'g(s="x]) ,\\"")', "h()", ", ", "(", ")", " ", "\n", "Sure", "'", "k(v=[1, {'a': true}])",
])


def test_pythonic_calls():
    text = ' [get_weather(city="Paris, \\"FR\\")", unit=\'c\'), get_time(), ns.f(x=[1, {"a": true}], y=null)]'
    assert parse(PythonicCalls(), [text])[:2] == ("", [
        ("get_weather", '{"city": "Paris, \\"FR\\")", "unit": "c"}'), ("get_time", "{}"),
        ("ns.f", '{"x": [1, {"a": true}], "y": null}')])
    for not_calls in ("[1, 2]", "[f(1)]", "[f(a=g())]", "[f(**kw)]", "[]", "[f(a=1)"):  # content as written
        assert parse(PythonicCalls(), [not_calls])[:2] == (not_calls, []), not_calls
    assert parse(PythonicCalls(), ["[f(a=1)] and more"])[:2] == (" and more", [("f", '{"a": 1}')])
    escaped = r'[f(s="\")")]'  # an escaped quote, then a bracket, inside the string
    assert parse(PythonicCalls(), list(escaped))[:2] == ("", [("f", r'{"s": "\")"}')])
    assert parse(PythonicCalls(max_calls=1), ["[f(a=1), g(b='x'), h()]"])[:2] == ("[g(b='x'), h()]", [("f", '{"a": 1}')])
    p = PythonicCalls()
    assert p.feed("[f(a=").calls == [] and p.feed("1)").calls == [] and [c.name for c in p.feed("]").calls] == ["f"]


def _starts_with(*marks):
    return lambda text: text.lstrip().startswith(marks)


# per parser: the pieces its texts are made of, and which texts must come back as content exactly,
# with no call (hermes: any text it reads no call in; the others: a reply that does not begin as calls)
PARSERS = {
    HermesCalls: (HERMES_PARTS, None),
    Llama3JsonCalls: (LLAMA_PARTS, _starts_with("{", "<|python_tag|>")),
    PythonicCalls: (PYTHONIC_PARTS, _starts_with("[")),
}


@pytest.mark.parametrize("parser", list(PARSERS), ids=lambda c: c.__name__)
@settings(max_examples=300, deadline=None)
@given(data=st.data(), positions=st.lists(st.integers(0, 10_000), max_size=12), max_calls=st.sampled_from([None, 1]))
def test_an_auto_parser_reads_the_same_however_the_text_is_cut(parser, data, positions, max_calls):
    parts, calls_start = PARSERS[parser]
    text = data.draw(st.lists(parts, max_size=10).map("".join))
    whole = parse(parser(max_calls), [text])[:2]
    assert parse(parser(max_calls), cuts(text, positions))[:2] == whole
    content, calls = whole
    if (not calls) if calls_start is None else not calls_start(text):
        assert (content, calls) == (text, [])
    if max_calls == 1:
        assert len(calls) <= 1
