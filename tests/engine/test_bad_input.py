"""Bad input gets a clear error naming the problem, never a deep traceback or a hang."""
import json
import subprocess
import sys

import pytest

from adaspec import LLM, SamplingParams
from adaspec.errors import ConfigError, InvalidRequestError, ModelLoadError


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-5), "top_k"),
    (dict(n=2), "n must be 1"),
    (dict(stop=[""]), "stop"),
    (dict(logprobs=99), "logprobs"),
    (dict(temperature="hot"), "temperature"),
])
def test_invalid_sampling_params(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "nope"))


def test_corrupt_model_dir(micro_qwen3, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(micro_qwen3, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="corrupt weights"):
        LLM(str(bad))
    (bad / "config.json").write_text("{ broken")
    with pytest.raises(ModelLoadError, match="config.json is not valid JSON"):
        LLM(str(bad))


def test_unsupported_architecture(micro_qwen3, tmp_path):
    import shutil

    bad = tmp_path / "gpt2"
    shutil.copytree(micro_qwen3, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(bad))


def test_prompt_too_long_and_other_request_errors(micro_qwen3):
    llm = LLM(str(micro_qwen3), max_model_len=32)
    with pytest.raises(InvalidRequestError, match="max_model_len is 32"):
        llm.generate([[1] * 32], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 10**6]], SamplingParams())
    # nothing was left behind by the failed calls
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and eng.kv_blocks_free() == eng.kv_blocks_total()


def test_engine_config_errors(micro_qwen3):
    with pytest.raises(ConfigError, match="unknown engine argument"):
        LLM(str(micro_qwen3), max_num_seq=3)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        LLM(str(micro_qwen3), max_model_len=10**6)
    with pytest.raises(ConfigError, match="fewer than one request"):
        LLM(str(micro_qwen3), num_kv_blocks=2, block_size=4)


def test_cli_reports_errors_cleanly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "adaspec.cli", "generate", str(tmp_path / "none"), "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "model directory not found" in r.stderr and "Traceback" not in r.stderr


def test_cli_generate(micro_qwen3):
    r = subprocess.run([sys.executable, "-m", "adaspec.cli", "generate", str(micro_qwen3), "--prompt", "def f",
                        "--max-tokens", "5", "--json", "--ignore-eos"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
