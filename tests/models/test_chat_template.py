"""Chat templates render here as transformers renders them (what vLLM's chat runs), tools and
earlier tool calls included, so a Hugging Face checkpoint's own template gives the same prompt."""
from __future__ import annotations

import json
import shutil

import pytest

from adaspec.errors import InvalidRequestError
from adaspec.models.registry import resolve_model_path
from adaspec.models.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer, check_template_kwargs

transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'then'",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
     {"role": "tool", "content": "21C", "tool_call_id": "c1"}, {"role": "assistant", "content": "Warm."}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
     {"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}],
]

# A template in the style of the Hugging Face hub's: blocks on lines of their own (trim_blocks and
# lstrip_blocks decide its whitespace), `if tools` on a variable only set with tools, tojson with
# options, loop controls, raise_exception, transformers' generation tag.
HUB_STYLE = """{%- if tools %}
    <tools>
    {%- for tool in tools %}
    {{ tool | tojson(indent=1) }}
    {%- endfor %}
    </tools>
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'robot' %}{{ raise_exception('no robots') }}{% endif %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    <{{ message['role'] }}>
    {% generation %}{{ message['content'] }}{% endgeneration %}
    {% for call in message.tool_calls or [] %}
        call {{ call.function.name }} {{ call.function.arguments | tojson }}
    {% endfor %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


# one that trims what a message says (continue_final_message must then cut before the trimmed space)
TRIMMING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module", params=["default", "hub-style", "trimming"])
def pair(request, tmp_path_factory):
    """(adaspec's Tokenizer, transformers' tokenizer) of one directory and one template."""
    path = tmp_path_factory.mktemp(request.param)
    src = resolve_model_path("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, path / name)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = {"default": DEFAULT_CHAT_TEMPLATE, "hub-style": HUB_STYLE, "trimming": TRIMMING}[request.param]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_prompt_is_transformers(pair, conversation, tools, add_generation_prompt):
    ours, theirs = pair
    want = theirs.apply_chat_template(conversation, tools=tools, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tools=tools) == want


def test_the_default_template_writes_tools_and_calls_in_the_hermes_convention():
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE  # the shipped model carries it
    plain = tok.apply_chat_template(CONVERSATIONS[1])
    assert plain == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n"
    text = tok.apply_chat_template(CONVERSATIONS[2], tools=TOOLS, add_generation_prompt=False)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}\n{call}<|im_end|>\n<|im_start|>tool\n21C<|im_end|>\n" in text
    with_system = tok.apply_chat_template(CONVERSATIONS[1], tools=TOOLS)
    assert with_system.startswith("<|im_start|>system\nbe brief\n\n# Tools\n") and with_system.count("be brief") == 1


def test_a_template_that_raises_is_an_invalid_request(pair):
    ours, _ = pair
    if ours.chat_template != HUB_STYLE:
        pytest.skip("only the hub-style template raises")
    with pytest.raises(InvalidRequestError, match="no robots"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])


NAMED = [{"name": "default", "template": "{% for m in messages %}<{{ m.content }}>{% endfor %}"},
         {"name": "tool_use", "template": "{{ (tools or []) | length }} tools{% for m in messages %}<{{ m.content }}>{% endfor %}"}]


@pytest.fixture()
def named_pair(tmp_path):
    src = resolve_model_path("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": NAMED}))
    return Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))


def test_named_templates_are_picked_as_transformers_picks_them(named_pair):
    ours, theirs = named_pair
    msgs = CONVERSATIONS[0]
    for kw in ({}, {"tools": TOOLS}, {"chat_template": "tool_use"}, {"chat_template": "[{{ messages | length }}]"}):
        want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(msgs, **kw) == want, kw
    assert ours.apply_chat_template(msgs) == "<hi>" and ours.apply_chat_template(msgs, tools=TOOLS) == "2 tools<hi>"


def test_a_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    src = resolve_model_path("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}({{ m.content }}){% endfor %}")
    ours, theirs = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    want = theirs.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert ours.apply_chat_template(CONVERSATIONS[1]) == want == "(be brief)(weather?)"


def test_a_template_that_does_not_compile_or_a_template_by_keyword_is_refused():
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    with pytest.raises(InvalidRequestError, match="does not compile"):
        tok.apply_chat_template(CONVERSATIONS[0], chat_template="{% for m in messages %}")
    with pytest.raises(InvalidRequestError, match="set by adaspec"):  # a request's chat_template_kwargs
        check_template_kwargs({"chat_template": "{{ 1 }}"})
    with pytest.raises(InvalidRequestError, match="none of them 'default'"):
        Tokenizer(tok._tok, {"chat_template": [{"name": "a", "template": "x"}]}, set()).apply_chat_template([])


@pytest.mark.parametrize("final", ["The answer is", "Ends with a space ", ""])
def test_continue_final_message_is_transformers(pair, final):
    ours, theirs = pair
    conv = CONVERSATIONS[1] + [{"role": "assistant", "content": final}]
    want = theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    got = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    assert got == want and got.rstrip().endswith(final.rstrip())


def test_continue_final_message_refuses_what_it_cannot_do():
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    conv = [{"role": "assistant", "content": "so"}]
    with pytest.raises(InvalidRequestError, match="cannot also add a generation prompt"):
        tok.apply_chat_template(conv, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="does not write the last message"):
        tok.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True, chat_template="{{ 'x' }}")
    with pytest.raises(InvalidRequestError, match="last message with text"):
        tok.apply_chat_template([], add_generation_prompt=False, continue_final_message=True)


def test_a_message_reaches_the_template_as_vllm_passes_it():
    from adaspec.models.tokenizer import message_for_template

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    m = message_for_template({"role": "assistant", "content": None, "tool_calls": [call], "reasoning": "hm"}, "m")
    assert m == {"role": "assistant", "content": "", "reasoning": "hm", "reasoning_content": "hm",
                 "tool_calls": [{**call, "function": {"name": "f", "arguments": {"a": 1}}}]}
    assert message_for_template({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                "m")["content"] == "ab"
    with pytest.raises(InvalidRequestError, match="Only an assistant message"):
        message_for_template({"role": "user", "content": "x", "tool_calls": [call]}, "m")
    # Qwen3's template reads an earlier reply's reasoning_content
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    thinking = "{% for m in messages %}{{ m.reasoning_content or '' }}|{{ m.content }};{% endfor %}"
    assert tok.apply_chat_template([m], add_generation_prompt=False, chat_template=thinking) == "hm|;"


@pytest.mark.parametrize("template", ["{{ 'a' * 10**10 }}", "{{ [0] * 2000000 }}", "{{ 3 * 'ab' * 600000 }}",
                                      "{{ 2 ** 100000 }}", "{% for i in range(10**9) %}{% endfor %}"])
def test_a_hostile_template_is_refused_not_run(template):
    """What a request's own template (--trust-request-chat-template) could spend the server's memory
    or time on is an InvalidRequestError."""
    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(CONVERSATIONS[0], chat_template=template)
    assert tok.apply_chat_template(CONVERSATIONS[0], chat_template="{{ 'ab' * 3 }}{{ 2 ** 10 }}") == "ababab1024"
