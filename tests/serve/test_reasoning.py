"""--reasoning-parser (serve/reasoning.py): thinking between <think> and </think> goes to the
message's "reasoning", the rest to "content", the same whether the text streams or not; where the
reply starts is read off the template's generation prompt."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
from hypothesis import given, settings, strategies as st
from live_server import LiveServer, openai_client

from adaspec.errors import ConfigError
from adaspec.serve.reasoning import ThinkSplitter, prompt_opens_thinking
from adaspec.serve.state import ServerSettings
from test_tool_parsers import cuts

PARTS = st.sampled_from(["<think>", "</think>", "<thi", "</th", "<", "hm", " ", "\n", "answer", "é", "think>"])


def split(pieces, in_reasoning: bool) -> tuple[str, str]:
    s = ThinkSplitter(in_reasoning)
    out = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def reference(text: str, in_reasoning: bool) -> tuple[str, str]:
    """The rule on a whole text, written plainly."""
    if not in_reasoning:
        head = text.lstrip()
        if not head.startswith("<think>"):
            return "", text
        text = head[len("<think>"):]
    if "</think>" in text:
        end = text.index("</think>")
        return text[:end], text[end + len("</think>"):]
    return text, ""


@settings(max_examples=400, deadline=None)
@given(st.lists(PARTS, max_size=10).map("".join), st.lists(st.integers(0, 10_000), max_size=12), st.booleans())
def test_a_streamed_text_splits_as_the_whole_text_and_the_rule_says(text, positions, in_reasoning):
    assert split(cuts(text, positions), in_reasoning) == split([text], in_reasoning) == reference(text, in_reasoning)


@pytest.mark.parametrize("text, in_reasoning, want", [
    ("<think>\nhm\n</think>\n\nHello", False, ("\nhm\n", "\n\nHello")),
    ("  <think>hm</think>Hi", False, ("hm", "Hi")),
    ("hm</think>Hi</think>", True, ("hm", "Hi</think>")),  # only the first closing tag ends it
    ("Hello <think>no</think>", False, ("", "Hello <think>no</think>")),  # a reply that starts in content
    ("<think>cut short", False, ("cut short", "")),
    ("still thinking", True, ("still thinking", "")),
    ("<thin", False, ("", "<thin")),
    ("", True, ("", "")),
])
def test_what_goes_where(text, in_reasoning, want):
    assert split([text], in_reasoning) == want


def test_the_prompt_decides_where_the_reply_starts():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_an_unknown_reasoning_parser_is_refused():
    with pytest.raises(ConfigError, match="deepseek_r1"):
        ServerSettings(served_model_names=["m"], reasoning_parser="granite")


# -- on the real engine, the tiny model held to a reply shape by guided_regex ----------------------

ENGINE_ARGS = dict(max_num_seqs=8, max_model_len=1024, device="cpu")
MSGS = [{"role": "user", "content": "why?"}]
# a template whose generation prompt opens the thinking, as DeepSeek-R1's does
OPENING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def _server(tmp_path_factory, template: str | None):
    pytest.importorskip("torch")
    from adaspec.config import EngineConfig
    from adaspec.models.registry import resolve_model_path
    from adaspec.serve.cli import build_engine

    model = resolve_model_path("tiny")
    if template is not None:
        model = tmp_path_factory.mktemp("opening") / "tiny"
        shutil.copytree(resolve_model_path("tiny"), model)
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return LiveServer(functools.partial(build_engine, EngineConfig(model=str(model), **ENGINE_ARGS)), names=("tiny",),
                      reasoning_parser="qwen3")


@pytest.fixture(scope="module", params=["own-think", "opening-prompt"])
def served(request, tmp_path_factory):
    s = _server(tmp_path_factory, OPENING if request.param == "opening-prompt" else None)
    yield request.param, s
    s.close()


def _streamed(client, **kw):
    reasoning = content = ""
    finish = None
    for chunk in client.chat.completions.create(model="tiny", messages=MSGS, stream=True, **kw):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish


def test_thinking_goes_to_reasoning_streamed_or_not(served):
    kind, server = served
    client = openai_client(server)
    if kind == "opening-prompt":  # the reply starts inside the thinking: the tiny model never ends it
        kw = dict(max_tokens=12, temperature=0)
        r = client.chat.completions.create(model="tiny", messages=MSGS, **kw)
        msg = r.choices[0].message
        assert msg.content is None and msg.reasoning and r.choices[0].finish_reason == "length"
        assert _streamed(client, **kw) == (msg.reasoning, "", "length")
        return
    regex = "<think>[a-z]{1,6}( [a-z]{1,6}){2,4}</think>[A-Z][a-z]{1,8}\\."  # it writes its own <think>
    kw = dict(max_tokens=80, temperature=0, extra_body={"guided_regex": regex})
    r = client.chat.completions.create(model="tiny", messages=MSGS, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    words = msg.reasoning.split(" ")
    assert 3 <= len(words) <= 5 and all(w.isalpha() and w.islower() for w in words)
    assert msg.content[0].isupper() and msg.content.endswith(".") and "think" not in msg.content
    assert _streamed(client, **kw) == (msg.reasoning, msg.content, "stop")
    inside = 0  # replies cut short inside the thinking: all of it is reasoning
    for n in range(1, r.usage.completion_tokens):
        cut = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=n, temperature=0,
                                             extra_body={"guided_regex": regex}).choices[0]
        assert cut.finish_reason == "length"
        if cut.message.reasoning and cut.message.content is None:
            inside += 1
            assert (msg.reasoning + "</think>").startswith(cut.message.reasoning)  # (a piece of the tag too)
        else:  # the tag not whole yet (content so far), or the thinking over
            assert cut.message.reasoning in (None, msg.reasoning)
    assert inside >= 2


def test_a_constrained_reply_is_content(served):
    """Held to a shape from its first token, it answers at once: content even where the prompt
    opened <think> (vLLM would let it think first)."""
    kind, server = served
    client = openai_client(server)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0,
                                       extra_body={"guided_choice": ["Yes.", "No."]})
    assert (r.choices[0].message.reasoning, r.choices[0].message.content in ("Yes.", "No.")) == (None, True)
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0,
                                       extra_body={"guided_regex": "(Yes|No)\\."})
    assert (r.choices[0].message.reasoning, r.choices[0].message.content in ("Yes.", "No.")) == (None, True)
    named = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}}}
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=20, temperature=0, tools=[named],
                                       tool_choice={"type": "function", "function": {"name": "f"}})
    assert r.choices[0].message.reasoning is None
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["a"] in ("x", "y")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=12))
def test_thinking_then_calls_read_the_same_streamed_or_whole(positions):
    """--reasoning-parser with --tool-call-parser hermes: the thinking goes to reasoning, then the
    content's calls are read (formatting.ChoiceReader), chunk by chunk as at once."""
    from adaspec.serve.formatting import Formatter
    from adaspec.serve.prepare import ChatReading
    from adaspec.serve.tools import ToolPlan

    text = ('<think>\nmaybe f</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"a": "<think>"}}\n'
            '</tool_call>')
    reading = ChatReading(ToolPlan("auto", parser="hermes"), thinking=False)
    whole = Formatter(True, "r", 0, "m", None, None, reading=reading).choice(0, text, [], None, "stop", None)
    msg = whole["message"]
    assert (msg["reasoning"], msg["content"], whole["finish_reason"]) == ("\nmaybe f", "\n\nSure.", "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("f", '{"a": "<think>"}')]
    fmt = Formatter(True, "r", 0, "m", None, None, reading=reading)
    pieces = cuts(text, positions)
    deltas = [fmt.chunk(0, p, [], None, "stop" if i == len(pieces) - 1 else None, None, False)
              for i, p in enumerate(pieces)]
    got = [d["choices"][0] for d in deltas if d is not None]
    assert "".join(c["delta"].get("reasoning", "") for c in got) == msg["reasoning"]
    assert "".join(c["delta"].get("content", "") for c in got) == msg["content"]
    calls = [t for c in got for t in c["delta"].get("tool_calls", [])]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in calls] == [("f", '{"a": "<think>"}')]
    assert got[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("waits", [True, False])
def test_a_constrained_reply_thinks_first_where_the_engines_grammar_waits(waits):
    """adaspec serve --reasoning-parser sets the engine's too: its grammars wait for the end of the
    thinking, so a constrained reply after a prompt that opened <think> starts in reasoning; an
    engine whose grammars do not wait holds it from its first token, so it is content."""
    from types import SimpleNamespace

    from adaspec.models.registry import resolve_model_path
    from adaspec.models.tokenizer import Tokenizer
    from adaspec.serve.prepare import prepare_chat
    from adaspec.serve.protocol import ChatCompletionRequest

    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    engine = SimpleNamespace(tokenizer=tok, max_model_len=1024, sampling_defaults={}, model_name="m",
                             grammar_waits_for_thinking=waits)
    from adaspec.serve.state import ServeState

    state = ServeState(ServerSettings(served_model_names=["m"], reasoning_parser="qwen3", chat_template=OPENING),
                       SimpleNamespace(engine=engine))
    req = ChatCompletionRequest(messages=MSGS, max_tokens=8, guided_regex="[a-z]+</think>[A-Z]")
    assert prepare_chat(state, req)[2].thinking is waits
    plain = ChatCompletionRequest(messages=MSGS, max_tokens=8)
    assert prepare_chat(state, plain)[2].thinking is True  # unconstrained: the prompt decides


def test_serve_passes_the_reasoning_parser_to_the_engine():
    import argparse

    from adaspec.serve.cli import add_parser, engine_config_from_args, settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "tiny", "--reasoning-parser", "qwen3", "--no-engine-process"])
    assert engine_config_from_args(args).reasoning_parser == settings_from_args(args).reasoning_parser == "qwen3"
