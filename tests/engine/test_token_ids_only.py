"""skip_tokenizer_init (vLLM's name): a model directory without tokenizer files runs on token ids."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from adaspec import LLM, SamplingParams
from adaspec.errors import InvalidRequestError, ModelLoadError

ARGS = dict(num_kv_blocks=64, block_size=16, max_model_len=256, device="cpu")
PROMPTS = [[5, 17, 42, 99], [200, 3], list(range(30, 60))]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def no_tokenizer_dir(micro_qwen3, tmp_path_factory):
    """The micro model without its tokenizer files (config.json / generation_config.json stay)."""
    d = tmp_path_factory.mktemp("no_tok") / "model"
    shutil.copytree(micro_qwen3, d)
    for name in TOKENIZER_FILES:
        (d / name).unlink(missing_ok=True)
    return d


@pytest.fixture(scope="module")
def llm(no_tokenizer_dir):
    return LLM(str(no_tokenizer_dir), skip_tokenizer_init=True, **ARGS)


def test_without_the_flag_a_missing_tokenizer_is_an_error(no_tokenizer_dir):
    with pytest.raises(ModelLoadError, match="tokenizer.json not found"):
        LLM(str(no_tokenizer_dir), **ARGS)


def test_token_ids_in_token_ids_out_same_tokens_as_with_a_tokenizer(llm, micro_qwen3):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(str(micro_qwen3), **ARGS).generate(PROMPTS, params)
    got = llm.generate(PROMPTS, params)
    assert llm.get_tokenizer() is None
    for g, r, p in zip(got, ref, PROMPTS):
        assert g.prompt is None and g.prompt_token_ids == p
        assert g.outputs[0].token_ids == r.outputs[0].token_ids and len(g.outputs[0].token_ids) == 12
        assert r.outputs[0].text and g.outputs[0].text == ""
        assert g.outputs[0].finish_reason == "length"


def test_text_prompt_is_refused(llm):
    with pytest.raises(InvalidRequestError, match="skip_tokenizer_init.*list of token ids") as e:
        llm.generate("def f():", SamplingParams(max_tokens=4))
    assert e.value.param == "prompt"


def test_stop_strings_are_refused_stop_token_ids_work(llm):
    with pytest.raises(InvalidRequestError, match="stop strings.*skip_tokenizer_init.*stop_token_ids") as e:
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, stop=["\n"]))
    assert e.value.param == "stop"
    first = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    third = first.outputs[0].token_ids[2]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                  stop_token_ids=[third]))[0]
    cut = first.outputs[0].token_ids.index(third) + 1
    assert out.outputs[0].token_ids == first.outputs[0].token_ids[:cut]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", third)


def test_eos_comes_from_the_model_configs(no_tokenizer_dir, tmp_path):
    """Without tokenizer_config.json, generation_config.json / config.json name the EOS ids."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = LLM(str(no_tokenizer_dir), skip_tokenizer_init=True, **ARGS).generate(PROMPTS[1], params)[0]
    eos = first.outputs[0].token_ids[1]
    for name in ("generation_config.json", "config.json"):
        d = tmp_path / name
        shutil.copytree(no_tokenizer_dir, d)
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos if name.startswith("gen") else 1}))
        cfg = json.loads((d / "config.json").read_text())
        cfg["eos_token_id"] = [eos] if name == "config.json" else 1
        (d / "config.json").write_text(json.dumps(cfg))
        out = LLM(str(d), skip_tokenizer_init=True, **ARGS).generate(PROMPTS[1], SamplingParams(temperature=0.0,
                                                                                                max_tokens=8))[0]
        stop_at = first.outputs[0].token_ids.index(eos) + 1
        assert out.outputs[0].token_ids == first.outputs[0].token_ids[:stop_at], name
        assert out.outputs[0].finish_reason == "stop"


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "adaspec.cli", "generate", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_generate_cli_token_ids(no_tokenizer_dir, llm):
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    r = _cli(no_tokenizer_dir, "--skip-tokenizer-init", "--prompt-token-ids", "5,17,42,99", "--max-tokens", "5",
             "--ignore-eos", "--device", "cpu", "--num-kv-blocks", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == ref.outputs[0].token_ids and out["text"] == ""
    assert out["prompt_token_ids"] == PROMPTS[0]
    r = _cli(no_tokenizer_dir, "--skip-tokenizer-init", "--prompt", "def f", "--device", "cpu",
             "--num-kv-blocks", "64")
    assert r.returncode == 2 and "skip_tokenizer_init" in r.stderr and "Traceback" not in r.stderr
    r = _cli(no_tokenizer_dir, "--skip-tokenizer-init", "--prompt-token-ids", "1,x")
    assert r.returncode == 2 and "not a list of token ids" in r.stderr


def test_speculative_decoding_runs_without_a_tokenizer(tmp_path):
    """The drafter needs no tokenizer either (its mask token id is in its config.json)."""
    from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir

    target = make_micro_model_dir(tmp_path / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    drafter = make_bigram_drafter_dir(tmp_path / "drafter", target, block_size=4)
    for name in TOKENIZER_FILES:
        (target / name).unlink(missing_ok=True)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(target), skip_tokenizer_init=True, **ARGS).generate(PROMPTS, params)
    spec = LLM(str(target), skip_tokenizer_init=True, **ARGS, speculative_config={
        "method": "dspark", "model": str(drafter), "num_speculative_tokens": 4})
    got = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert all(o.outputs[0].text == "" for o in got)
    assert spec.llm_engine.stats.num_accepted_tokens > 0
