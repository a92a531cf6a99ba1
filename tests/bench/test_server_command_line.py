"""The logged `serve` command line is pasteable: the --speculative-config JSON is shell-quoted."""
import shlex

from adaspec.bench.server import ServerProcess


def test_command_line_round_trips_through_the_shell(tmp_path):
    spec = {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": True}
    s = ServerProcess("my model", spec, tmp_path / "log", extra_args=["--max-num-seqs", "8"])
    line = s.command_line()
    assert shlex.split(line) == s.command()
    assert "'{\"method\": \"dspark\"" in line  # the JSON is one quoted word
