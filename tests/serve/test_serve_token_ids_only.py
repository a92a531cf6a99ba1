"""`adaspec serve --skip-tokenizer-init`: token-id prompts work, anything needing text is a 400."""
from __future__ import annotations


import httpx
import pytest
from live_server import LiveServer

pytest.importorskip("torch")
testing = pytest.importorskip("adaspec.testing")

ENGINE_ARGS = dict(max_num_seqs=8, num_kv_blocks=64, block_size=16, max_model_len=256, device="cpu")
PROMPT = [5, 17, 42, 99]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = testing.make_micro_model_dir(tmp_path_factory.mktemp("skip_tok") / "micro")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()
    return str(d)


@pytest.fixture(scope="module")
def server(model_dir):
    from adaspec.config import EngineConfig
    from adaspec.engine.llm_engine import LLMEngine

    s = LiveServer(lambda: LLMEngine(EngineConfig(model=model_dir, skip_tokenizer_init=True, **ENGINE_ARGS)),
                   names=("micro",))
    yield s
    s.close()


def _post(server, path, body):
    return httpx.post(server.url + path, json={"model": "micro", **body}, timeout=60)


def test_flag_reaches_engine_config():
    from adaspec.cli import build_parser
    from adaspec.serve.cli import engine_config_from_args

    assert engine_config_from_args(build_parser().parse_args(["serve", "m", "--skip-tokenizer-init"])).skip_tokenizer_init
    assert not engine_config_from_args(build_parser().parse_args(["serve", "m"])).skip_tokenizer_init


def test_token_id_prompt_works_and_tokens_come_back_as_ids(server, model_dir):
    from adaspec import LLM, SamplingParams

    ref = LLM(model_dir, skip_tokenizer_init=True, **ENGINE_ARGS).generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                          "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref]  # vLLM's spelling without a tokenizer
    assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    stream = _post(server, "/v1/completions", {"prompt": [PROMPT, PROMPT[:2]], "max_tokens": 3, "stream": True})
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "def f():"}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"prompt": "hi"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["\n"]}, "stop"),
])
def test_text_needs_are_a_400_naming_the_problem(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert "skip-tokenizer-init" in err["message"] or "skip_tokenizer_init" in err["message"]
