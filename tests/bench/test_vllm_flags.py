"""`bench serve` takes `vllm bench serve`'s flags and writes its result keys and file name."""
import json
import re

import pytest

from adaspec.bench.cli import resolve_endpoint
from adaspec.cli import main
from adaspec.errors import AdaspecError

from .fakeserver import FakeServer, Script

SC = Script(chunks=[(0.0, "a", 1), (0.0, "bc", 2)], prompt_tokens=3)


def test_backend_and_endpoint_resolution():
    assert resolve_endpoint(None, None) == ("completions", None)
    assert resolve_endpoint("openai-chat", None) == ("chat", None)
    assert resolve_endpoint("vllm", None) == ("completions", None)
    assert resolve_endpoint(None, "/v1/chat/completions") == ("chat", "/v1/chat/completions")
    assert resolve_endpoint("openai", "/proxy/v1/completions/") == ("completions", "/proxy/v1/completions")
    assert resolve_endpoint("openai-chat", "/gen") == ("chat", "/gen")
    with pytest.raises(AdaspecError, match="speaks the chat API"):
        resolve_endpoint("openai-chat", "/v1/completions")
    with pytest.raises(AdaspecError, match="starting with /"):
        resolve_endpoint(None, "v1/completions")
    with pytest.raises(AdaspecError, match="--backend"):
        resolve_endpoint(None, "/gen")


def test_vllm_style_run(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    with FakeServer({}, default=SC) as srv:
        argv = ["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
                "--base-url", srv.url, "--model", "org/fake-model", "--dataset-name", "custom",
                "--dataset-path", str(prompts), "--num-prompts", "3", "--max-concurrency", "2",
                "--random-output-len", "5", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9",
                "--save-result", "--result-dir", str(tmp_path / "res"), "--disable-tqdm"]
        assert main(argv) == 0
        body = srv.requests[-1]
    assert body["messages"][0]["content"].startswith("p") and body["max_tokens"] == 5
    files = list((tmp_path / "res").iterdir())
    assert len(files) == 1
    # vLLM's default name: LABEL-RATEqps-concurrencyC-MODEL-DATE.json
    assert re.fullmatch(r"openai-chat-infqps-concurrency2-fake-model-\d{8}-\d{6}\.json", files[0].name), files[0].name
    res = json.loads(files[0].read_text())
    assert res["backend"] == "openai-chat" and res["endpoint_path"] == "/v1/chat/completions"
    assert res["completed"] == 3 and res["total_output_tokens"] == 9
    for key in ("p50_ttft_ms", "p99.9_ttft_ms", "p50_e2el_ms", "p99.9_e2el_ms", "mean_tpot_ms", "median_itl_ms"):
        assert key in res, key
    assert not any(re.fullmatch(r"p[\d.]+_(tpot|itl|itl_token)_ms", k) for k in res)
    for key in ("date", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency", "duration",
                "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                "max_concurrent_requests"):
        assert key in res, key
    # as vLLM: the per-request lists only with --save-detailed
    for key in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "errors", "send_offsets", "generated_texts"):
        assert key not in res, key
    assert re.fullmatch(r"\d{8}-\d{6}", res["date"]) and res["started_at"].startswith(res["date"][:4])
    assert res["request_goodput"] is None  # no --goodput: not measured
    out = capsys.readouterr().out
    assert "P99.9 TTFT (ms):" in out and "P50 E2EL (ms):" in out


def test_result_filename_and_bad_flags(tmp_path, capsys):
    with FakeServer({}, default=SC) as srv:
        base = ["bench", "serve", "--base-url", srv.url, "--model", "m", "--dataset", "random", "--tokenizer", "tiny",
                "--random-input-len", "4", "--num-prompts", "1", "--disable-tqdm"]
        assert main(base + ["--save-result", "--result-filename", "x.json", "--result-dir", str(tmp_path)]) == 0
        assert json.loads((tmp_path / "x.json").read_text())["completed"] == 1
        assert main(base + ["--result-filename", "y.json"]) == 2
        for bad in (["--percentile-metrics", "ttft,nope"], ["--metric-percentiles", "0"], ["--goodput", "ttft"],
                    ["--goodput", "itl:5"], ["--goodput", "ttft:-1"]):
            with pytest.raises(SystemExit) as e:  # argparse's usage error
                main(base + bad)
            assert e.value.code == 2
    err = capsys.readouterr().err
    assert "add --save-result" in err and "expected names from ttft,tpot,itl,e2el" in err
