"""--chat-template: a template file, or the template itself, or the name of one of the model's, for
every chat request and /tokenize; one that does not compile stops the server from starting."""
from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import httpx
import pytest
from live_server import LiveServer

from adaspec.errors import ConfigError
from adaspec.serve.cli import read_chat_template
from adaspec.serve.state import ServerSettings, ServeState

pytest.importorskip("torch")

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
MSGS = [{"role": "user", "content": "hello there"}]


def test_the_flag_reads_a_file_a_template_or_a_name(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert read_chat_template(str(f)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template("tool_use") == "tool_use"
    with pytest.raises(ConfigError, match="looks like a file path"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def _state(template: str, tokenizer):
    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=64, sampling_defaults={}, model_name="m")
    return ServeState(ServerSettings(served_model_names=["m"], chat_template=template),
                      SimpleNamespace(engine=engine))


def test_a_template_that_does_not_compile_stops_the_server():
    from adaspec.models.registry import resolve_model_path
    from adaspec.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model_path("tiny"))
    assert _state(TEMPLATE, tok).settings.chat_template == TEMPLATE
    with pytest.raises(ConfigError, match="--chat-template: the chat template does not compile"):
        _state("{% if x %}", tok)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        _state(TEMPLATE, None)
    with pytest.raises(ConfigError, match="neither one of this model's named templates"):
        _state("chatml", tok)  # a mistyped name or path would have been every prompt, word for word


def test_every_chat_request_and_tokenize_uses_it(tmp_path):
    from adaspec import LLM, SamplingParams
    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine

    args = dict(max_num_seqs=4, max_model_len=512, device="cpu")
    s = LiveServer(functools.partial(build_engine, EngineConfig(model="tiny", **args)), names=("tiny",),
                   chat_template=TEMPLATE)
    try:
        tok = s.state.tokenizer
        want = tok.encode("[user: hello there]>")
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "temperature": 0},
                       timeout=60).json()
        assert r["usage"]["prompt_tokens"] == len(want)
        assert httpx.post(s.url + "/tokenize", json={"messages": MSGS}, timeout=60).json()["tokens"] == want
        offline = LLM("tiny", **args).chat(MSGS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                                           chat_template=TEMPLATE)[0]
        assert offline.prompt == "[user: hello there]>" and offline.prompt_token_ids == want
        assert r["choices"][0]["message"]["content"] == offline.outputs[0].text
        # continue_final_message: the prompt stops inside the last message, which the reply continues
        begun = MSGS + [{"role": "assistant", "content": "It is"}]
        cont = httpx.post(s.url + "/v1/chat/completions", json={"messages": begun, "max_tokens": 4, "temperature": 0,
                                                                "continue_final_message": True}, timeout=60).json()
        want = tok.encode("[user: hello there][assistant: It is")
        assert cont["usage"]["prompt_tokens"] == len(want)
        offline = LLM("tiny", **args).chat(begun, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                                           chat_template=TEMPLATE, add_generation_prompt=False,
                                           continue_final_message=True)[0]
        assert offline.prompt_token_ids == want and cont["choices"][0]["message"]["content"] == offline.outputs[0].text
        own = {"messages": MSGS, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }}!"}
        refused = httpx.post(s.url + "/v1/chat/completions", json=own, timeout=60)
        assert refused.status_code == 400 and "--trust-request-chat-template" in refused.json()["error"]["message"]
        both = httpx.post(s.url + "/v1/chat/completions", json={"messages": begun, "continue_final_message": True,
                                                                "add_generation_prompt": True}, timeout=60)
        assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    finally:
        s.close()


def test_serve_takes_the_flag(tmp_path):
    from adaspec.serve.cli import add_parser, settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    args = parser.parse_args(["serve", "m", "--chat-template", str(f), "--no-engine-process"])
    assert settings_from_args(args).chat_template == TEMPLATE


def test_a_trusting_server_takes_a_requests_own_template():
    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine

    s = LiveServer(functools.partial(build_engine, EngineConfig(model="tiny", max_num_seqs=4, max_model_len=512,
                                                                device="cpu")),
                   names=("tiny",), chat_template=TEMPLATE, trust_request_chat_template=True)
    try:
        own = {"messages": MSGS, "chat_template": "{{ messages[0]['content'] }}!"}
        r = httpx.post(s.url + "/tokenize", json=own, timeout=60).json()
        assert r["tokens"] == s.state.tokenizer.encode("hello there!")
        bad = httpx.post(s.url + "/v1/chat/completions", json={**own, "chat_template": "{% if %}"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template", bad.text
        assert httpx.post(s.url + "/tokenize", json={"messages": MSGS}, timeout=60).json()["tokens"] == \
            s.state.tokenizer.encode("[user: hello there]>")  # --chat-template's otherwise
        strs = httpx.post(s.url + "/tokenize", json={"prompt": "hello there", "return_token_strs": True}, timeout=60).json()
        assert strs["token_strs"] == s.state.tokenizer.convert_ids_to_tokens(strs["tokens"]) and len(strs["tokens"]) > 1
    finally:
        s.close()
