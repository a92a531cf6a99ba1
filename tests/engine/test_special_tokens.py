"""A text prompt gets the tokenizer's special tokens (a Llama tokenizer's BOS), as vLLM encodes
one; chat-templated text does not (its template writes them); add_special_tokens overrides."""

import httpx
import pytest

from adaspec import LLM, SamplingParams
from adaspec.testing import add_bos_post_processor, make_micro_model_dir


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A micro Llama whose tokenizer prepends <|endoftext|> as its BOS (TemplateProcessing)."""
    d = make_micro_model_dir(tmp_path_factory.mktemp("bos") / "llama", arch="llama")
    return d, add_bos_post_processor(d)


def test_a_text_prompt_starts_with_the_bos_its_tokenizer_adds(llama_dir):
    d, bos = llama_dir
    llm = LLM(str(d), device="cpu", max_model_len=64, num_kv_blocks=16)
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=2))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == [bos] + tok.encode("hello")
    assert tok.encode("hello", add_special_tokens=True) == [bos] + tok.encode("hello")
    ids = llm.generate([tok.encode("hello")], SamplingParams(temperature=0, max_tokens=2))[0].prompt_token_ids
    assert ids == tok.encode("hello")  # token ids are taken as given


def test_the_server_adds_them_to_completions_not_to_chat(llama_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
    from live_server import LiveServer

    from adaspec.config import EngineConfig
    from adaspec.serve.cli import build_engine

    d, bos = llama_dir
    s = LiveServer(lambda: build_engine(EngineConfig(model=str(d), device="cpu", max_model_len=64, num_kv_blocks=16)),
                   names=("m",))
    try:
        def tokens(**body):
            r = httpx.post(s.url + "/tokenize", json=body)
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        plain = tokens(prompt="hello", add_special_tokens=False)
        assert tokens(prompt="hello") == [bos] + plain
        msgs = [{"role": "user", "content": "hi"}]
        templated = s.engine(lambda e: e.tokenizer.encode(e.tokenizer.apply_chat_template(msgs)))
        assert tokens(messages=msgs) == templated  # the template's text as it stands
        assert tokens(messages=msgs, add_special_tokens=True) == [bos] + templated
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(plain) + 1
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1, "add_special_tokens": False})
        assert r.json()["usage"]["prompt_tokens"] == len(plain)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 1, "add_special_tokens": "no"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
    finally:
        s.close()
