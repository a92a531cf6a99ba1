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
