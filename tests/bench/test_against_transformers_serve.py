"""`adaspec bench serve` against a server we did not write: `transformers serve` (Hugging Face's
OpenAI-compatible server) on the embedded tiny model, on CPU, offline (HF_HUB_OFFLINE=1: the model
loads from its local directory). That server ends a stream with a chunk carrying finish_reason and
usage and sends no `data: [DONE]`, and answers 422 to extension fields such as ignore_eos."""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from adaspec.bench.server import free_port, tail
from adaspec.cli import main

TINY = Path(__file__).resolve().parents[2] / "adaspec/assets/models/tiny"


@pytest.fixture(scope="module")
def transformers_server(tmp_path_factory):
    import httpx

    exe = shutil.which("transformers")
    assert exe, "the `transformers` CLI is missing: pip install -e '.[test]' (transformers[serving], accelerate)"
    log = tmp_path_factory.mktemp("tserve") / "serve.log"
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(log.parent / "hf"))
    with open(log, "wb") as f:
        proc = subprocess.Popen([exe, "serve", str(TINY), "--host", "127.0.0.1", "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # The wait is a bound on a hang, not a measurement: nothing asserts how long it took.
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with code {proc.returncode}:\n{tail(log)}")
            try:
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"transformers serve did not answer /health:\n{tail(log)}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_bench_serve_against_transformers_serve(transformers_server, tmp_path, backend, capsys):
    rc = main(["bench", "serve", "--base-url", transformers_server, "--backend", backend, "--dataset", "random",
               "--tokenizer", "tiny", "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "3",
               "--max-concurrency", "2", "--temperature", "0", "--num-warmups", "1", "--disable-tqdm",
               "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["completed"] == 3 and res["failed"] == 0, res["errors"]
    assert res["model_id"] == str(TINY)  # asked its /v1/models
    # no [DONE] from this server: complete, and counted
    assert res["streams_without_done"] == 3
    assert set(res["finish_reasons"]) <= {"length", "stop"}
    # tokens from its usage chunk, prompt tokens included
    assert res["usage_missing_requests"] == 0 and res["prompt_tokens_missing_requests"] == 0
    assert 3 <= res["total_output_tokens"] <= 3 * 8 and res["total_input_tokens"] >= 3 * 16
    assert res["median_ttft_ms"] is not None and res["metrics_available"] is False  # no /metrics there


@pytest.mark.slow
def test_ignore_eos_refusal_names_the_flag(transformers_server, capsys):
    argv = ["bench", "serve", "--base-url", transformers_server, "--dataset", "random", "--tokenizer", "tiny",
            "--random-input-len", "4", "--output-len", "4", "--num-prompts", "1", "--ignore-eos", "--disable-tqdm"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "HTTP 422" in err and "the server refused ignore_eos, sent because of --ignore-eos" in err
