"""`adaspec demo`: wiring through a fake `serve` launcher (fast), and the real thing once the
tiny model ships (slow)."""
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from adaspec.cli import build_parser, main
from adaspec.commands.demo import run_demo

HERE = Path(__file__).parent
TINY = Path(__file__).resolve().parents[2] / "adaspec/assets/models/tiny/config.json"


def test_demo_with_fake_server(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_LOG", str(tmp_path / "calls.jsonl"))
    opts = build_parser().parse_args(["demo", "--out", str(tmp_path / "d"), "--quick", "--model", "m0"])
    lines = []
    res = run_demo(opts, launcher=[sys.executable, str(HERE / "fake_serve_main.py")], log=lines.append)
    text = "\n".join(lines)
    assert "| C | none | fixed:7 | adaptive:7 |" in text
    assert "## Verdict per concurrency" in text and "- **C=4**" in text
    assert "## Reading" in text and "Pareto edge per concurrency" in text
    assert (tmp_path / "d" / "frontier.png").stat().st_size > 1000
    assert len(list((tmp_path / "d" / "points").glob("*.json"))) == 3 * 2
    assert "adaspec bench sweep --model m0 --arms none,fixed:7,adaptive:7 --concurrency 1,4" in text
    # a second run resumes (nothing to measure), --fresh measures again
    lines.clear()
    run_demo(opts, launcher=[sys.executable, str(HERE / "fake_serve_main.py")], log=lines.append)
    assert sum("points done, skipped" in l for l in lines) == 3


def _printed_command(lines):
    text = "\n".join(lines)
    return text.split("same as:\n  ", 1)[1].split("\n", 1)[0]


def test_printed_command_is_the_same_run(tmp_path, monkeypatch):
    """Parse the printed command back with the CLI's parser: it must give the demo's settings."""
    from adaspec.bench.cli import sweep_config_from_args

    monkeypatch.setenv("FAKE_SERVE_LOG", str(tmp_path / "calls.jsonl"))
    out = tmp_path / "a dir with spaces"
    opts = build_parser().parse_args(["demo", "--out", str(out), "--quick", "--model", "m0",
                                      "--server-arg=--max-model-len=512"])
    lines = []
    res = run_demo(opts, launcher=[sys.executable, str(HERE / "fake_serve_main.py")], log=lines.append)
    argv = shlex.split(_printed_command(lines))
    assert argv[:3] == ["adaspec", "bench", "sweep"]
    again = sweep_config_from_args(build_parser().parse_args(argv[1:]), log=lines.append)
    ran = res["config"]
    for f in dataclasses.fields(ran):
        if f.name not in ("log", "launcher"):
            assert getattr(again, f.name) == getattr(ran, f.name), f.name
    # the settings the issue found missing from the old printed command
    assert ran.num_warmups == 1 and ran.server_args == ["--max-num-seqs=4", "--max-model-len=512"]
    calls = [json.loads(l) for l in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls[0]["rest"] == ["--max-num-seqs=4", "--max-model-len=512"]


def test_demo_output_defaults_under_git_ignored_runs(tmp_path):
    from adaspec.commands.demo import out_dir

    root = Path(__file__).resolve().parents[2]
    for argv in (["demo"], ["demo", "--quick"]):
        d = out_dir(build_parser().parse_args(argv))
        assert d.startswith("runs/")
        ignored = __import__("subprocess").run(["git", "check-ignore", "-q", d + "/report.md"], cwd=root)
        assert ignored.returncode == 0, f"{d} is not git-ignored"
    # `adaspec profile`'s default folder, and the demo's old default, are ignored too
    prof = build_parser().parse_args(["profile", "tiny"]).out
    for d in (str(prof), "adaspec-demo"):
        assert __import__("subprocess").run(["git", "check-ignore", "-q", d + "/x.json"], cwd=root).returncode == 0, d


def test_demo_rejects_bad_concurrency(capsys):
    assert main(["demo", "--concurrency", "1,x", "--out", "/nonexistent/x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


# The real demo path starts three servers; with OMP_WAIT_POLICY=PASSIVE (adaspec/__init__.py) it
# takes 15-25 s on 2 CPU cores, so it runs in CI. ADASPEC_SKIP_SLOW_TESTS=1 skips it locally.
SLOW = pytest.mark.skipif(bool(os.environ.get("ADASPEC_SKIP_SLOW_TESTS")), reason="ADASPEC_SKIP_SLOW_TESTS is set")


@pytest.mark.slow
@SLOW
def test_real_demo_scaled_down_on_micro_models(tmp_path):
    """The demo's real path (three `adaspec serve` processes, speculation on and off) on a random
    micro target and a bigram drafter, scaled down for CI."""
    pytest.importorskip("adaspec.serve.cli", reason="adaspec.serve.cli is not built yet")
    testing = pytest.importorskip("adaspec.testing")
    target = testing.make_micro_model_dir(tmp_path / "t", arch="qwen3", seed=0)
    drafter = testing.make_bigram_drafter_dir(tmp_path / "d", target, block_size=7)
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--model", str(target), "--drafter", str(drafter), "--out", str(out),
                 "--dataset", "random", "--concurrency", "1,2", "--num-prompts", "2", "--output-len", "8"]) == 0
    md = (out / "report.md").read_text()
    assert "| C | none | fixed:7 | adaptive:7 |" in md and (out / "frontier.png").stat().st_size > 1000
    fixed = json.loads((out / "points" / "fixed-7_c2_r0.json").read_text())
    assert fixed["failed"] == 0 and fixed["spec_num_drafts"], "fixed-7: speculation counters did not move"
    # The adaptive arm may rightly draft nothing here: its cost tables are timed at startup, and on a
    # loaded 2-core CI machine the micro drafter's pass has been timed at 6x a target step (break-even
    # above 7 accepted tokens), so plain steps are its best choice. Whether it drafts when the tables
    # say drafting pays is tested with fixed tables (tests/spec_decode); here: it served everything
    # and its point carries the server's speculation counters.
    adaptive = json.loads((out / "points" / "adaptive-7_c2_r0.json").read_text())
    assert adaptive["failed"] == 0 and adaptive["completed"] == 2, adaptive
    assert adaptive.get("spec_num_drafts") is not None, "adaptive-7: the /metrics speculation counters were not read"


@pytest.mark.slow
@SLOW
@pytest.mark.skipif(not TINY.is_file(), reason="the embedded tiny model (adaspec/assets/models/tiny) is not shipped yet")
def test_real_demo_quick(tmp_path):
    pytest.importorskip("adaspec.serve.cli", reason="adaspec.serve.cli is not built yet")
    assert main(["demo", "--quick", "--out", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "report.md").is_file() and (tmp_path / "d" / "frontier.png").is_file()
