"""`bench serve` against the fake server: every metric equals its hand-computed value.

The scripted delays run on a virtual clock (fakeclock.py) that the server moves and the client
reads, so timings are exact however loaded the machine is: nothing here depends on wall time.
"""
import pytest

from adaspec.bench.runner import BenchConfig, run_benchmark
from .fakeclock import FakeClock
from .fakeserver import FakeServer, Script

SCRIPTS = {
    # 3 chunks carrying 1, 3, 2 tokens: usage says 6, chunk counting would say 3.
    "A": Script(chunks=[(0.10, "a", 1), (0.05, "bcd", 3), (0.10, "ef", 2)], prompt_tokens=5),
    "B": Script(chunks=[(0.05, "x", 1), (0.05, "yy", 2)], prompt_tokens=3),
    "C": Script(status=500, counts_spec=False),
    "D": Script(chunks=[(0.02, "p", 1), (0.02, "q", 1)], cut_after=1),  # connection cut mid-stream
    "E": Script(chunks=[(0.02, "p", 1)], done=False, finish=False),  # ends with neither [DONE] nor finish_reason
    "F": Script(chunks=[(0.05, "p", 1), (0.05, "qq", 2), (0.05, "r", 1)], usage=False),  # no usage chunk
}


def approx_ms(v):
    # float rounding of the virtual clock's sums only; the values themselves are exact
    return pytest.approx(v, rel=1e-9, abs=1e-9)


@pytest.fixture(scope="module")
def result():
    clock = FakeClock()
    with FakeServer(SCRIPTS, clock=clock) as srv:
        cfg = BenchConfig(
            base_url=srv.url + "/v1", model="fake-model",
            prompts=[f"s:{k}" for k in "ABCDEF"], max_concurrency=1, output_len=16,
            num_warmups=1, progress=False, clock=clock,
        )
        res = run_benchmark(cfg)
        res["_server_requests"] = list(srv.requests)
    assert not clock.stalled, "the client did not stamp the chunks with the injected clock"
    return res


def test_counts_and_failures(result):
    assert result["completed"] == 3
    assert result["failed"] == 3
    errs = result["errors"]
    assert errs[0] == "" and errs[1] == ""
    assert errs[2].startswith("HTTP 500")
    assert errs[3] and errs[4] == "stream ended before a finish_reason or data: [DONE]"
    assert errs[5] == ""
    # usage preferred: A has 3 chunks but 6 tokens; F has no usage and is flagged
    assert result["output_lens"] == [6, 3, 0, 0, 0, 3]
    assert result["total_output_tokens"] == 12
    assert result["total_input_tokens"] == 8
    assert result["usage_missing_requests"] == 1
    assert result["total_chunks"] == 3 + 2 + 3
    assert result["max_concurrent_requests"] == 1
    assert result["mean_tokens_per_chunk"] == pytest.approx(12 / 8)


def test_request_body(result):
    body = result["_server_requests"][-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 16 and body["model"] == "fake-model"


def test_ttft_itl_e2el(result):
    # TTFT: A 100, B 50, F 50 ms
    assert result["mean_ttft_ms"] == approx_ms(200 / 3)
    assert result["median_ttft_ms"] == approx_ms(50)
    assert result["p99_ttft_ms"] == approx_ms(50 + 0.98 * 50)  # linear between 50 and 100
    # chunk gaps: A 50,100; B 50; F 50,50
    assert result["mean_itl_ms"] == approx_ms(60)
    assert result["median_itl_ms"] == approx_ms(50)
    assert result["p99_itl_ms"] == approx_ms(50 + 0.96 * 50)
    # E2EL: A 250, B 100, F 150
    assert result["mean_e2el_ms"] == approx_ms(500 / 3)
    assert result["median_e2el_ms"] == approx_ms(150)


def test_tpot_and_per_user_speed(result):
    # TPOT = (E2EL - TTFT) / (out - 1): A 150/5 = 30, B 50/2 = 25, F 100/2 = 50 ms
    assert result["mean_tpot_ms"] == approx_ms(35)
    assert result["median_tpot_ms"] == approx_ms(30)
    # per-user speed = (out - 1) / (E2EL - TTFT): A 33.3, B 40, F 20 tok/s
    assert result["median_per_user_tok_s"] == pytest.approx(100 / 3)
    assert result["p10_per_user_tok_s"] == pytest.approx(20 + 0.2 * (100 / 3 - 20))


def test_token_normalized_itl(result):
    # no per-chunk counts: out-1 spread over the gaps. A: 2.5 tok/gap -> 20, 40 ms;
    # B: 25 ms (weight 2); F: 50, 50 (weight 1 each). Weighted mean 300/9.
    assert result["mean_itl_token_ms"] == approx_ms(300 / 9)
    assert result["median_itl_token_ms"] == approx_ms(25)
    assert result["p99_itl_token_ms"] == approx_ms(50)


def test_throughput(result):
    d = result["duration"]
    # requests run one at a time: 250 + 100 + 0 + 40 (D: 20, then cut after 20) + 20 + 150 ms
    assert d == pytest.approx(0.560)
    assert result["output_throughput"] == pytest.approx(12 / d)
    assert result["request_throughput"] == pytest.approx(3 / d)
    assert result["total_token_throughput"] == pytest.approx(20 / d)


def test_spec_counters_delta(result):
    # the warm-up request is excluded; A, B, D, E, F streamed (C failed before streaming)
    assert result["spec_num_drafts"] == 10
    assert result["spec_num_draft_tokens"] == 70
    assert result["spec_num_accepted_tokens"] == 25
    assert result["spec_acceptance_rate"] == pytest.approx(25 / 70)
    assert result["spec_mean_accepted_length"] == pytest.approx(3.5)
    assert result["spec_mean_verified_length"] == pytest.approx(8.0)
    assert result["spec_accepted_per_pos"] == [10, 10, 5, 0, 0, 0, 0]
    assert result["spec_acceptance_rate_per_pos"] == pytest.approx([1, 1, 0.5, 0, 0, 0, 0])
    assert result["metrics_available"] is True


def test_the_client_times_its_own_cpu(result):
    # the real clocks by default: some CPU seconds per wall second (its value depends on the host), over
    # a run of at least CLIENT_BUSY_MIN_WALL_S (this one, on a virtual clock, takes what the host takes)
    from adaspec.bench.metrics import CLIENT_BUSY_MIN_WALL_S

    assert isinstance(result["client_wall_s"], float) and result["client_wall_s"] >= 0
    if result["client_wall_s"] >= CLIENT_BUSY_MIN_WALL_S:
        assert isinstance(result["client_cpu_per_wall"], float) and result["client_cpu_per_wall"] >= 0
    else:
        assert result["client_cpu_per_wall"] is None
    # with fake clocks, the ratio of the CPU the requests' run took to its wall time
    cpu, wall = iter([10.0, 11.2]), iter([100.0, 102.0])
    clock = FakeClock()
    with FakeServer({"B": SCRIPTS["B"]}, clock=clock) as srv:
        res = run_benchmark(BenchConfig(base_url=srv.url + "/v1", model="fake-model", prompts=["s:B"], output_len=16,
                                        num_warmups=0, progress=False, clock=clock,
                                        cpu_clocks=(lambda: next(cpu), lambda: next(wall))))
    assert res["completed"] == 1 and res["client_cpu_per_wall"] == pytest.approx(0.6)


def test_continuous_usage_gives_exact_token_itl():
    clock = FakeClock()
    with FakeServer({"A": SCRIPTS["A"]}, metrics=False, clock=clock) as srv:
        cfg = BenchConfig(base_url=srv.url, model=None, prompts=["s:A"], max_concurrency=1,
                          continuous_usage=True, progress=False, temperature=0.0, clock=clock)
        res = run_benchmark(cfg)
    assert res["model_id"] == "fake-model"  # asked /v1/models
    assert res["chunk_tokens"] == [[1, 3, 2]]
    # gaps 50 ms / 3 tokens and 100 ms / 2 tokens, token weighted
    assert res["mean_itl_token_ms"] == approx_ms(30)
    assert res["median_itl_token_ms"] == approx_ms(50 / 3)
    assert res["p99_itl_token_ms"] == approx_ms(50)
    # no /metrics: spec fields are null, not zero
    assert res["metrics_available"] is False and res["spec_num_drafts"] is None


def test_chat_skips_role_chunk():
    clock = FakeClock()
    sc = Script(chunks=[(0.10, "a", 1), (0.05, "bb", 2)])
    with FakeServer({}, default=sc, clock=clock) as srv:
        cfg = BenchConfig(base_url=srv.url, model="fake-model", prompts=["hi"] * 2, max_concurrency=1,
                          endpoint="chat", progress=False, clock=clock)
        res = run_benchmark(cfg)
    assert res["completed"] == 2
    # the role chunk (sent at 0 ms) is not the first token: TTFT is the 100 ms of the first token
    assert res["ttfts"] == [approx_ms(0.100)] * 2
    assert res["latencies"] == [approx_ms(0.150)] * 2  # vLLM's key for the E2ELs


def test_concurrency_reaches_its_cap():
    sc = Script(chunks=[(0.01, "a", 1), (0.01, "bb", 2)])
    with FakeServer({}, default=sc, prefix="vllm:") as srv:
        cfg = BenchConfig(base_url=srv.url, model="fake-model", prompts=["hi"] * 4, max_concurrency=4,
                          endpoint="chat", progress=False)
        res = run_benchmark(cfg)
    assert res["completed"] == 4
    # an ordering, not a duration: all four were sent before any finished
    assert res["max_concurrent_requests"] == 4
    assert res["spec_num_drafts"] == 8  # vllm: prefix matched by suffix


def test_finished_stream_without_done_is_complete_and_counted():
    # transformers serve: the last chunk carries finish_reason and usage; no data: [DONE]
    clock = FakeClock()
    sc = Script(chunks=[(0.05, "a", 1), (0.05, "b", 1)], done=False)
    with FakeServer({}, default=sc, clock=clock) as srv:
        res = run_benchmark(BenchConfig(base_url=srv.url, model="m", prompts=["x", "y"], max_concurrency=1,
                                        progress=False, clock=clock))
    assert res["completed"] == 2 and res["failed"] == 0
    assert res["streams_without_done"] == 2
    assert res["total_output_tokens"] == 4 and res["finish_reasons"] == ["length", "length"]


def test_refused_extension_field_names_the_flag(capsys):
    from adaspec.cli import main

    sc = Script(chunks=[(0.0, "a", 1)], refuse=("ignore_eos",))
    with FakeServer({}, default=sc) as srv:
        res = run_benchmark(BenchConfig(base_url=srv.url, model="m", prompts=["x"], ignore_eos=True, progress=False))
        assert res["completed"] == 0
        assert res["errors"][0].startswith("HTTP 422")
        assert "the server refused ignore_eos, sent because of --ignore-eos" in res["errors"][0]
        # the same request without the flag is served
        ok = run_benchmark(BenchConfig(base_url=srv.url, model="m", prompts=["x"], progress=False))
        assert ok["completed"] == 1
        # and the CLI says so, also when the warm-up is what fails
        argv = ["bench", "serve", "--base-url", srv.url, "--model", "m", "--dataset", "random", "--tokenizer", "tiny", "--num-prompts", "1",
                "--ignore-eos", "--disable-tqdm"]
        assert main(argv) == 1
        assert "sent because of --ignore-eos" in capsys.readouterr().err
        assert main(argv + ["--num-warmups", "1"]) == 2
        assert "sent because of --ignore-eos" in capsys.readouterr().err
