"""--tensor-parallel-size reaches the engine from every command that has it."""
import json
import os
import subprocess
import sys


from adaspec.cli import build_parser


def test_flags_reach_the_engine_config():
    from adaspec.commands.options import engine_kwargs
    from adaspec.serve.cli import engine_config_from_args

    p = build_parser()
    assert engine_kwargs(p.parse_args(["generate", "tiny", "--prompt", "x", "-tp", "2"]))["tensor_parallel_size"] == 2
    assert engine_kwargs(p.parse_args(["profile", "tiny", "--tensor-parallel-size", "4"]))["tensor_parallel_size"] == 4
    assert engine_config_from_args(p.parse_args(["serve", "tiny", "--tensor-parallel-size", "2"])).tensor_parallel_size == 2
    assert engine_config_from_args(p.parse_args(["serve", "tiny"])).tensor_parallel_size == 1


def test_bench_sweep_passes_it_to_every_server(tmp_path):
    from adaspec.bench.cli import sweep_config_from_args

    args = build_parser().parse_args(["bench", "sweep", "--model", "tiny", "--out", str(tmp_path), "-tp", "2",
                                      "--server-arg=--max-num-seqs=8", "--dataset", "random",
                                      "--random-input-len", "8", "--num-prompts", "2", "--concurrency", "1"])
    cfg = sweep_config_from_args(args, log=lambda *a: None)
    assert cfg.server_args == ["--max-num-seqs=8", "--tensor-parallel-size", "2"]


def _generate(*extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", "import sys; from adaspec.cli import main; sys.exit(main())",
                          "generate", "tiny", "--device", "cpu", "--prompt", "def add(a, b):", "--max-tokens", "24",
                          "--ignore-eos", "--json", "--num-kv-blocks", "64", "--max-model-len", "256", *extra],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_generate_with_two_ranks_prints_what_one_rank_prints():
    assert _generate("-tp", "2")["token_ids"] == _generate()["token_ids"]


def test_generate_refuses_an_unshardable_size():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", "import sys; from adaspec.cli import main; sys.exit(main())",
                          "generate", "tiny", "--device", "cpu", "--prompt", "x", "-tp", "3"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode != 0
    assert "tensor_parallel_size=3 does not divide the 4 attention heads" in out.stderr
    assert "Traceback" not in out.stderr
