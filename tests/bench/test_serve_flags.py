"""`bench serve` flags and console: refusals by name, vLLM's flags (--backend kept as given,
--goodput's console line, --served-model-name, sampling parameters, request ids, the ready check,
--save-detailed), the model looked up for --dataset random, and the busy-client warning."""
import json

import pytest

from adaspec.cli import main

from .fakeserver import FakeServer, Script

SC = Script(chunks=[(0.0, "a", 1), (0.0, "bc", 2)], prompt_tokens=3)
UNREACHABLE = "http://127.0.0.1:9"


def test_negative_warmups_are_refused_by_name(tmp_path, capsys):
    base = ["--model", "m", "--dataset", "random", "--tokenizer", "tiny", "--random-input-len", "4",
            "--num-warmups", "-1", "--disable-tqdm"]
    assert main(["bench", "serve", "--base-url", UNREACHABLE, "--num-prompts", "1"] + base) == 2
    assert "--num-warmups must be at least 0, got -1" in capsys.readouterr().err
    assert main(["bench", "sweep", "--arms", "none", "--out", str(tmp_path / "o")] + base) == 2
    assert "--num-warmups must be at least 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_run_of_milliseconds_is_never_called_cpu_bound():
    """A run against a server that refuses at once is all client work: 0.01 CPU s in 0.01 wall s is
    no sign of a lagging client (it was judged 1.0, 'CPU-bound')."""
    from adaspec.bench.runner import BenchConfig, format_summary, run_benchmark

    refusing = Script(status=500)
    for cpu, wall, judged in (([10.0, 10.01], [100.0, 100.01], None), ([10.0, 11.9], [100.0, 102.0], 0.95)):
        it_cpu, it_wall = iter(cpu), iter(wall)
        with FakeServer({}, default=refusing) as srv:
            res = run_benchmark(BenchConfig(base_url=srv.url, model="m", prompts=["x"], output_len=4, progress=False,
                                            cpu_clocks=(lambda: next(it_cpu), lambda: next(it_wall))))
        assert res["failed"] == 1 and res["client_cpu_per_wall"] == judged
        assert res["client_wall_s"] == pytest.approx(wall[1] - wall[0])
        assert ("the client was CPU-bound" in format_summary(res)) == (judged is not None)


def _serve(srv, tmp_path, *extra):
    return ["bench", "serve", "--base-url", srv.url, "--dataset", "random", "--tokenizer", "tiny",
            "--random-input-len", "4", "--num-prompts", "2", "--disable-tqdm", "--save-result",
            "--result-dir", str(tmp_path), *extra]


def _saved(tmp_path):
    (f,) = list(tmp_path.glob("*.json"))
    res = json.loads(f.read_text())
    f.unlink()
    return f.name, res


def test_backend_is_kept_as_given(tmp_path):
    with FakeServer({}, default=SC) as srv:
        assert main(_serve(srv, tmp_path, "--model", "m", "--backend", "vllm")) == 0
        name, res = _saved(tmp_path)
        assert res["backend"] == "vllm" and name.startswith("vllm-infqps-m-")
        assert main(_serve(srv, tmp_path, "--model", "m")) == 0  # no --backend: the API spoken, as before
        name, res = _saved(tmp_path)
        assert res["backend"] == "openai" and name.startswith("openai-infqps-m-")


def test_goodput_has_its_console_line(tmp_path, capsys):
    with FakeServer({}, default=SC) as srv:
        assert main(_serve(srv, tmp_path, "--model", "m", "--goodput", "e2el:60000")) == 0
        out = capsys.readouterr().out
        _, res = _saved(tmp_path)
        assert main(_serve(srv, tmp_path, "--model", "m")) == 0
        plain = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("Request goodput (req/s):"))
    assert float(line.split(":")[1]) == pytest.approx(res["request_goodput"], abs=0.005) and res["request_goodput"] > 0
    # vLLM's place: right under the request throughput
    lines = out.splitlines()
    assert lines[lines.index(line) - 1].startswith("Request throughput (req/s):")
    assert "Request goodput" not in plain


def test_vllm_request_flags_reach_the_server(tmp_path):
    srv, headers = FakeServer({}, default=SC), []
    normal = srv._completions

    async def seen(request):
        headers.append(request.headers.get("x-request-id"))
        return await normal(request)

    srv._completions = seen  # routed to once the server starts
    with srv:
        assert main(_serve(srv, tmp_path, "--model", "org/big-model", "--served-model-name", "alias", "--top-p",
                           "0.9", "--top-k", "20", "--min-p", "0.05", "--request-id-prefix", "run7-",
                           "--num-warmups", "1")) == 0
        bodies = list(srv.requests)
    name, res = _saved(tmp_path)
    assert len(bodies) == 3 and headers == ["run7-warmup-0", "run7-0", "run7-1"]
    for b in bodies:
        assert b["model"] == "alias" and (b["top_p"], b["top_k"], b["min_p"]) == (0.9, 20, 0.05)
    # vLLM's result: model_id is --model (so is the file name), the served name beside it
    assert res["model_id"] == "org/big-model" and res["served_model_name"] == "alias" and "-big-model-" in name
    assert (res["top_p"], res["top_k"], res["min_p"], res["request_id_prefix"]) == (0.9, 20, 0.05, "run7-")


def test_sampling_flags_are_not_sent_unless_given(tmp_path):
    with FakeServer({}, default=SC) as srv:
        assert main(_serve(srv, tmp_path, "--model", "m")) == 0
        bodies = list(srv.requests)
    _, res = _saved(tmp_path)
    assert not any(k in b for b in bodies for k in ("top_p", "top_k", "min_p"))
    assert res["request_id_prefix"] is None
    assert bodies[0]["model"] == "m" and res["served_model_name"] is None and res["top_p"] is None


def _models_server(ids_by_call):
    """A fake server whose /v1/models answers call i with ids_by_call(i): (status, model id)."""
    from aiohttp import web

    srv, calls = FakeServer({}, default=SC), []

    async def models(request):
        status, mid = ids_by_call(len(calls))
        calls.append(status)
        if status != 200:
            return web.json_response({"error": "loading"}, status=status)
        return web.json_response({"object": "list", "data": [{"id": mid, "object": "model"}]})

    srv._models = models
    return srv, calls


def test_the_ready_check_waits_for_the_server_to_answer(tmp_path, monkeypatch, capsys):
    from adaspec.bench import runner

    monkeypatch.setattr(runner, "READY_POLL_S", 0.001)
    srv, calls = _models_server(lambda i: (503, None) if i < 2 else (200, "m"))
    with srv:
        assert main(_serve(srv, tmp_path, "--model", "m")) == 0
        assert calls == [503, 503, 200] and len(srv.requests) == 2  # nothing sent before it answered
    assert capsys.readouterr().err.count(f"waiting up to 600 s for {srv.url} to answer (HTTP 503)") == 1
    _saved(tmp_path)
    srv, calls = _models_server(lambda i: (503, None))
    with srv:
        assert main(_serve(srv, tmp_path, "--model", "m", "--ready-check-timeout-sec", "0.05")) == 2
        assert not srv.requests
        assert "did not answer GET /v1/models within 0.05 s (--ready-check-timeout-sec" in capsys.readouterr().err
        assert main(_serve(srv, tmp_path, "--model", "m", "--ready-check-timeout-sec", "0")) == 0  # no wait
        assert len(srv.requests) == 2 and len(calls) >= 2
    assert main(["bench", "serve", "--ready-check-timeout-sec", "-1", "--model", "m"]) == 2
    assert "--ready-check-timeout-sec must be at least 0" in capsys.readouterr().err


def test_save_detailed_writes_the_per_request_lists(tmp_path, capsys):
    with FakeServer({}, default=SC) as srv:
        assert main(_serve(srv, tmp_path, "--model", "m", "--save-detailed")) == 0
        _, res = _saved(tmp_path)
        assert res["generated_texts"] == ["abc", "abc"] and res["output_lens"] == [3, 3]
        assert res["errors"] == ["", ""] and len(res["itls"]) == 2 and len(res["send_offsets"]) == 2
        argv = [a for a in _serve(srv, tmp_path, "--model", "m", "--save-detailed") if a != "--save-result"]
        argv = argv[:argv.index("--result-dir")] + argv[argv.index("--result-dir") + 2:]
        assert main(argv) == 2
    assert "--save-detailed says what --save-result writes; add --save-result" in capsys.readouterr().err


def test_random_prompts_without_model_use_the_model_the_server_names(tmp_path):
    """--dataset random counts tokens with the model's tokenizer: without --model (and --tokenizer)
    it asked for --tokenizer, though the server names its model at /v1/models."""
    srv, calls = _models_server(lambda i: (200, "tiny"))
    with srv:
        argv = [a for a in _serve(srv, tmp_path) if a not in ("--tokenizer", "tiny")]
        assert main(argv) == 0
        assert [b["model"] for b in srv.requests] == ["tiny", "tiny"]
    _, res = _saved(tmp_path)
    assert res["model_id"] == "tiny" and res["completed"] == 2
