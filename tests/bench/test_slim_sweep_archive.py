"""benchmarks/slim_sweep_archive.py: a sweep archive loses its points' per-request chunk arrays and
its server logs' per-request lines and nothing else, and is refused when slimming would change the
report."""
import json
import sys
import tarfile
from pathlib import Path

import pytest

from adaspec.bench.report import write_report
from adaspec.testing import load_benchmark
from tests.bench.test_pareto_report import SYN, write_points



def load_script():
    return load_benchmark("slim_sweep_archive")


# a server's log: two requests (each an access line and a request line) among the lines that stay
LOG = """INFO:     Started server process [42]
2026-12-03 17:43:38,776 INFO adaspec.serve: request cmpl-5ab5: 1 prompt(s) of 370 tokens, SamplingParams(n=1)
INFO:     127.0.0.1:5012 - "POST /v1/completions HTTP/1.1" 200 OK
2026-12-03 17:43:38,800 INFO adaspec.spec_decode: cost tables (json): {"verify": []}
2026-12-03 17:43:38,801 INFO adaspec.serve: request chatcmpl-77e1: 1 prompt(s) of 12 tokens, SamplingParams(n=1)
INFO:     127.0.0.1:5013 - "POST /v1/chat/completions HTTP/1.1" 200 OK
INFO:     127.0.0.1:5014 - "GET /metrics HTTP/1.1" 200 OK
"""


def sweep_archive(tmp_path) -> Path:
    sweep = tmp_path / "run" / "server_T0"
    points = [dict(p, itls=[[0.01 * i, 0.02]], chunk_tokens=[[1, 2]], ttfts=[0.1 * (i + 1)]) for i, p in enumerate(SYN)]
    write_points(sweep, points, {"model": "m", "arms": [{"name": "none"}, {"name": "fixed:7"}], "repeats": 3})
    (sweep / "logs").mkdir()
    (sweep / "logs" / "none.log").write_text(LOG)
    write_report(sweep)
    (sweep / "report.md").write_text("the report as the run wrote it\n")  # kept as written, not rebuilt
    archive = tmp_path / "server_T0.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        t.add(sweep, arcname="server_T0")
    return archive


def members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as t:
        return {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}


def test_the_points_lose_their_chunk_arrays_and_nothing_else(tmp_path, monkeypatch, capsys):
    archive, out = sweep_archive(tmp_path), tmp_path / "slim.tar.xz"
    monkeypatch.setattr(sys, "argv", ["slim", str(archive), str(out)])
    assert load_script().main() == 0
    before, after = members(archive), members(out)
    assert sorted(before) == sorted(after)
    for name, data in before.items():
        if name.endswith("logs/none.log"):  # the per-request lines go, counted; every other line stays
            assert after[name].decode() == (
                "INFO:     Started server process [42]\n"
                "2026-12-03 17:43:38,800 INFO adaspec.spec_decode: cost tables (json): {\"verify\": []}\n"
                "INFO:     127.0.0.1:5014 - \"GET /metrics HTTP/1.1\" 200 OK\n"
                "[slim_sweep_archive.py: 4 per-request lines removed (uvicorn's access log and the server's "
                "request log)]\n")
            continue
        if "/points/" not in name:
            assert after[name] == data, name  # manifest, report and plot as written
            continue
        full, slim = json.loads(data), json.loads(after[name])
        assert slim["itls"] is None and slim["chunk_tokens"] is None and full["itls"] is not None
        assert {k: v for k, v in slim.items() if k not in ("itls", "chunk_tokens")} == \
            {k: v for k, v in full.items() if k not in ("itls", "chunk_tokens")}
    assert "12 points slimmed, 4 per-request log lines removed, report unchanged" in capsys.readouterr().out


def test_a_slimming_that_changes_the_report_writes_nothing(tmp_path, monkeypatch):
    archive, out = sweep_archive(tmp_path), tmp_path / "slim.tar.xz"
    mod = load_script()
    monkeypatch.setattr(mod, "DROPPED_ARRAYS", ("itls", "output_throughput"))  # a field the report reads
    monkeypatch.setattr(sys, "argv", ["slim", str(archive), str(out)])
    with pytest.raises(SystemExit, match="changes once slimmed"):
        mod.main()
    assert not out.exists()
