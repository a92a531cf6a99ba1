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
    (dict(n=0), "n must be an integer in"),
    (dict(n=True), "n must be an integer in"),
    (dict(n=2.0), "n must be an integer in"),
    (dict(n=4097), "n must be an integer in"),
    (dict(n=2**63), "n must be an integer in"),
    (dict(stop=[""]), "stop"),
    (dict(logprobs=99), "logprobs"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=1e308), "temperature"),
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=9223372036854775808), "top_k"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"),
])
def test_invalid_sampling_params(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_tiny_positive_temperature_is_greedy():
    # dividing logits by 1e-39 gives inf/NaN: below vLLM's _SAMPLING_EPS a temperature is greedy
    for t in (1e-39, 5e-324, 9e-6):
        p = SamplingParams(temperature=t)
        assert p.greedy and p.temperature == 0.0
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_value_the_step_cannot_use_fails_its_request_alone(micro_qwen3):
    # SamplingParams is mutable: add_request verifies it again, so a bad value never reaches the
    # step, where it would fail every request of the batch (the server's engine thread died of it).
    llm = LLM(str(micro_qwen3), max_model_len=64)
    eng = llm.llm_engine
    ok = SamplingParams(temperature=0.7, max_tokens=3, seed=1)
    eng.add_request("ok", [1, 2, 3], ok)
    for field, value in (("top_k", 9223372036854775808), ("seed", 2**64), ("temperature", float("nan")),
                         ("top_p", 0.0)):
        bad = SamplingParams(temperature=0.7, max_tokens=3)
        setattr(bad, field, value)
        with pytest.raises(InvalidRequestError, match=field):
            eng.add_request(f"bad-{field}", [1, 2, 3], bad)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"]
    assert len(outs[-1].outputs[0].token_ids) == 3


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
    # with speculation: the max_model_len given, the draft block named apart (it read max_model_len=263)
    with pytest.raises(ConfigError, match=r"max_model_len=256 needs \(17, with its 7-position draft block\)"):
        LLM("tiny", device="cpu", max_model_len=256, num_kv_blocks=16, speculative_config={"num_speculative_tokens": 7})
    with pytest.raises(ConfigError, match=r"cudagraph_mode must be one of .*'PIECEWISE' \(piecewise graphs are not"):
        LLM(str(micro_qwen3), cudagraph_mode="PIECEWISE")
    assert LLM(str(micro_qwen3), cudagraph_mode="FULL").llm_engine.runner.graphs is None  # graphs need CUDA


@pytest.mark.parametrize("kwargs, needle", [
    (dict(enable_chunked_prefill="false"), "engine argument enable_chunked_prefill must be true or false, got 'false'"),
    (dict(enforce_eager="no"), "enforce_eager must be true or false"),
    (dict(async_scheduling="false"), "async_scheduling must be true or false or null"),
    (dict(max_model_len=True), "max_model_len must be an integer or null, got True"),
    (dict(block_size=True), "block_size must be an integer, got True"),
    (dict(seed=1.5), "seed must be an integer or null, got 1.5"),
    (dict(seed=2**64), "seed must be a 64-bit integer or null"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number or null"),
])
def test_engine_arguments_of_the_wrong_type(micro_qwen3, kwargs, needle):
    """A flag given as the string "false" once counted as true, and True as the integer 1."""
    with pytest.raises(ConfigError, match=needle):
        LLM(str(micro_qwen3), **kwargs)


@pytest.mark.parametrize("key, value, needle", [
    ("enable_adaptive_verification", "false", "enable_adaptive_verification must be true or false, got 'false'"),
    ("reserve_all_spec_slots", "no", "reserve_all_spec_slots must be true or false"),
    ("profile_repeats", 0, "profile_repeats must be a positive integer, got 0"),
    ("profile_repeats", "3", "profile_repeats must be an integer, got '3'"),
    ("profile_repeats", 2.5, "profile_repeats must be an integer, got 2.5"),
    ("profile_context_len", True, "profile_context_len must be an integer, got True"),
    ("adaptive_verification_ema_alpha", True, "adaptive_verification_ema_alpha must be a number or null"),
    ("num_speculative_tokens", 2.0, "num_speculative_tokens must be an integer or null"),
])
def test_speculative_config_keys_of_the_wrong_type(key, value, needle):
    """Refused when the config is read, before any drafter loads or cost table is profiled (a bad
    profile_repeats once failed deep inside the profiler with a bare TypeError)."""
    from adaspec.config import SpeculativeConfig

    with pytest.raises(ConfigError, match=needle):
        SpeculativeConfig.from_dict({"method": "dspark", key: value})
    good = {"profile_repeats": 3, "enable_adaptive_verification": True, "adaptive_verification_ema_alpha": 1}
    assert SpeculativeConfig.from_dict(good).profile_repeats == 3  # an int where a float is asked is fine


def test_a_budget_that_cannot_hold_a_whole_prompt_without_chunking_is_refused(micro_qwen3):
    """Without chunked prefill a prompt runs in one step: a token budget below max_model_len once
    left a longer prompt waiting forever (generate never returned); now the engine is refused."""
    from adaspec.engine.scheduler import check_whole_prompts_fit

    with pytest.raises(ConfigError, match=r"max_num_batched_tokens=16 must be at least max_model_len=64"):
        LLM(str(micro_qwen3), enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=64)
    llm = LLM(str(micro_qwen3), enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64)
    out = llm.generate([list(range(5, 55))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4  # a 50-token prompt in one step
    check_whole_prompts_fit(16, 64, True)  # chunked prefill: any budget
    check_whole_prompts_fit(96, 64, False, 4, 7, reserve_all_spec_slots=False)
    with pytest.raises(ConfigError, match=r"less the 32 draft slots .* max_num_seqs=4 x k=8"):
        check_whole_prompts_fit(95, 64, False, 4, 8, reserve_all_spec_slots=True)
    check_whole_prompts_fit(96, 64, False, 4, 8, reserve_all_spec_slots=True)


def test_cudagraph_mode_default_depends_on_speculation():
    from adaspec.config import resolve_cudagraph_mode

    assert resolve_cudagraph_mode(None, speculative=False) == "FULL"
    assert resolve_cudagraph_mode(None, speculative=True) == "FULL"  # mixed graphs passed the H200 tests
    for asked in ("FULL", "FULL_DECODE_ONLY", "NONE"):
        assert resolve_cudagraph_mode(asked, speculative=True) == asked == resolve_cudagraph_mode(asked, False)


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
