"""`adaspec demo`: wiring through a fake `serve` launcher (fast), and the real thing once the
tiny model ships (slow)."""
import os
import sys
import time
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
    assert (tmp_path / "d" / "frontier.png").stat().st_size > 1000
    assert len(list((tmp_path / "d" / "points").glob("*.json"))) == 3 * 2
    assert "adaspec bench sweep --model m0 --arms none,fixed:7,adaptive:7 --concurrency 1,4" in text
    # a second run resumes (nothing to measure), --fresh measures again
    lines.clear()
    run_demo(opts, launcher=[sys.executable, str(HERE / "fake_serve_main.py")], log=lines.append)
    assert sum("points done, skipped" in l for l in lines) == 3


def test_demo_rejects_bad_concurrency(capsys):
    assert main(["demo", "--concurrency", "1,x", "--out", "/nonexistent/x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not TINY.is_file(), reason="the embedded tiny model (adaspec/assets/models/tiny) is not shipped yet")
def test_real_demo_quick(tmp_path):
    pytest.importorskip("adaspec.serve.cli", reason="adaspec.serve.cli is not built yet")
    t0 = time.monotonic()
    assert main(["demo", "--quick", "--out", str(tmp_path / "d")]) == 0
    assert (tmp_path / "d" / "report.md").is_file() and (tmp_path / "d" / "frontier.png").is_file()
    assert time.monotonic() - t0 < 300
