"""A load that moves (`--load-phases`): the concurrency cap of every phase is honoured, per-phase
metrics equal hand computations, `bench serve` and `bench sweep` carry them, the report shows them.

Nothing here depends on wall time: the metric values run on a virtual clock (fakeclock.py), the
concurrency checks on a clock that ticks once per read (an ordering of the client's own events)
and on a fake server that holds requests until a phase's concurrency is reached.
"""
import asyncio
import itertools
import json
import sys
from pathlib import Path

import pytest

from adaspec.bench import client
from adaspec.bench.cli import sweep_config_from_args
from adaspec.bench.phases import PhaseError, parse_phases, phase_of_requests
from adaspec.bench.report import write_report
from adaspec.bench.runner import BenchConfig, run_benchmark
from adaspec.bench.sweep import run_sweep
from adaspec.cli import build_parser, main
from adaspec.errors import AdaspecError

from .fakeclock import FakeClock
from .fakeserver import FakeServer, Script

HERE = Path(__file__).parent


def tick_clock(step: float = 0.001):
    n = itertools.count(1)
    return lambda: next(n) * step


def approx(v):
    return pytest.approx(v, rel=1e-9, abs=1e-9)


def test_parse_phases():
    ph = parse_phases("1x20, 64X200,1x20")
    assert [(p.max_concurrency, p.num_requests) for p in ph] == [(1, 20), (64, 200), (1, 20)]
    assert phase_of_requests(parse_phases("2x2,1x3")) == [0, 0, 1, 1, 1]
    for bad in ("", "1x", "x3", "0x5", "4x0", "4*5", "1x2,,abc"):
        with pytest.raises(PhaseError):
            parse_phases(bad)


def in_flight_at_sends(results):
    """For every request: how many requests (itself included) were in flight when it was sent,
    from the client's own send and end stamps."""
    return [sum(1 for o in results if o.send_time <= r.send_time < o.end_time) for r in results]


def test_every_send_respects_its_phase_cap_and_each_phase_reaches_it():
    # up (1 -> 4), down (4 -> 1: drains first), up to 2, and down again
    phases = parse_phases("1x3,4x8,1x3,2x4,1x2")
    idx = phase_of_requests(phases)
    caps = [phases[p].max_concurrency for p in idx]
    quick = [(0.002, "a", 1), (0.002, "bb", 2)]
    scripts = {f"P{i}": Script(chunks=quick, hold_first=p.max_concurrency if p.max_concurrency > 1 else 0)
               for i, p in enumerate(phases)}
    with FakeServer(scripts) as srv:
        payloads = [client.build_payload(client.RequestSpec(prompt=f"s:P{p}", max_tokens=4), "m", "completions", False)
                    for p in idx]
        results, first, last = asyncio.run(client.run_requests(
            srv.url + "/v1/completions", payloads, "completions", None, [0.0] * len(payloads),
            clock=tick_clock(), caps=caps))
        assert not srv.stalled, "a phase never reached its concurrency"
    assert all(r.success for r in results), [r.error for r in results]
    flight = in_flight_at_sends(results)
    assert all(f <= c for f, c in zip(flight, caps)), list(zip(idx, flight, caps))
    # sent in order
    assert [r.send_time for r in results] == sorted(r.send_time for r in results)
    # each phase of concurrency C had C requests in flight at once (the server held them until it did)
    for i, p in enumerate(phases):
        mine = [r for r, q in zip(results, idx) if q == i]
        assert max(sum(1 for o in mine if o.send_time <= r.send_time < o.end_time) for r in mine) == p.max_concurrency
    # going down, the first request of the C=1 phase waited for the whole C=4 phase to finish
    first_of_2 = results[idx.index(2)]
    assert all(r.end_time <= first_of_2.send_time for r, q in zip(results, idx) if q == 1)


SCRIPTS = {
    "A": Script(chunks=[(0.10, "a", 1), (0.05, "bcd", 3), (0.10, "ef", 2)], prompt_tokens=5),
    "B": Script(chunks=[(0.05, "x", 1), (0.05, "yy", 2)], prompt_tokens=3),
    "F": Script(chunks=[(0.05, "p", 1), (0.05, "qq", 2), (0.05, "r", 1)], prompt_tokens=2),
}


@pytest.fixture(scope="module")
def phased_result():
    clock = FakeClock()
    with FakeServer(SCRIPTS, clock=clock) as srv:
        res = run_benchmark(BenchConfig(base_url=srv.url, model="fake-model", prompts=["s:A", "s:B", "s:F"],
                                        load_phases=parse_phases("1x2,1x1"), output_len=8, progress=False,
                                        clock=clock))
    assert not clock.stalled
    return res


def test_per_phase_metrics_equal_hand_computations(phased_result):
    res = phased_result
    assert res["load_phases"] == "1x2,1x1" and res["request_phases"] == [0, 0, 1]
    # whole run: A (250 ms, 6 tokens) then B (100 ms, 3 tokens) then F (150 ms, 4 tokens)
    assert res["duration"] == approx(0.5) and res["total_output_tokens"] == 13
    assert res["output_throughput"] == approx(13 / 0.5)
    p0, p1 = res["phases"]
    assert (p0["phase"], p0["max_concurrency"], p0["num_requests"]) == (0, 1, 2)
    assert (p1["phase"], p1["max_concurrency"], p1["num_requests"]) == (1, 1, 1)
    # phase 0: A and B, from A's send to B's end
    assert p0["start_s"] == approx(0.0) and p0["end_s"] == approx(0.35) and p0["duration"] == approx(0.35)
    assert p0["completed"] == 2 and p0["total_output_tokens"] == 9 and p0["total_input_tokens"] == 8
    assert p0["output_throughput"] == approx(9 / 0.35)
    # per-user speed: A (6-1)/0.15 = 33.3, B (3-1)/0.05 = 40; TTFT: A 100, B 50 ms
    assert p0["median_per_user_tok_s"] == approx((100 / 3 + 40) / 2)
    assert p0["p90_per_user_tok_s"] == approx(100 / 3 + 0.9 * (40 - 100 / 3))
    assert p0["median_ttft_ms"] == approx(75.0) and p0["p99_ttft_ms"] == approx(50 + 0.99 * 50)
    # phase 1: F alone, 350 ms to 500 ms: (4-1)/0.10 = 30 tok/s, TTFT 50 ms
    assert p1["start_s"] == approx(0.35) and p1["end_s"] == approx(0.5)
    assert p1["output_throughput"] == approx(4 / 0.15)
    assert p1["median_per_user_tok_s"] == approx(30.0) and p1["median_ttft_ms"] == approx(50.0)
    assert p0["max_concurrent_requests"] == 1 and p1["max_concurrent_requests"] == 1


def test_summary_prints_the_phases(phased_result):
    from adaspec.bench.runner import format_summary, result_filename

    text = format_summary(phased_result)
    assert "Load phases" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("1 "))
    assert "1x1" in row and "26.7" in row and "30.0" in row
    assert "-phases1x2-1x1-" in result_filename(phased_result)


def test_bench_serve_cli_runs_phases_and_refuses_conflicts(tmp_path, capsys):
    sc = Script(chunks=[(0.0, "a", 1), (0.0, "bb", 2)], hold_first=0)
    with FakeServer({}, default=sc) as srv:
        base = ["bench", "serve", "--base-url", srv.url, "--model", "m", "--dataset", "random", "--tokenizer", "tiny",
                "--disable-tqdm"]
        assert main(base + ["--load-phases", "1x2,3x6", "--save-result", "--result-dir", str(tmp_path),
                            "--result-filename", "r.json"]) == 0
        out = capsys.readouterr().out
        assert "Load phases" in out
        res = json.loads((tmp_path / "r.json").read_text())
        assert res["completed"] == 8 and [p["num_requests"] for p in res["phases"]] == [2, 6]
        assert len(srv.requests) == 8
        assert main(base + ["--load-phases", "1x2", "--max-concurrency", "4"]) == 2
        assert "drop --max-concurrency" in capsys.readouterr().err
        assert main(base + ["--load-phases", "1x2", "--num-prompts", "4", "--request-rate", "3"]) == 2
        assert "drop --num-prompts, --request-rate" in capsys.readouterr().err
        with pytest.raises(SystemExit):  # argparse's own error for a bad value
            main(base + ["--load-phases", "2x0"])
        assert "concurrency and requests must be at least 1" in capsys.readouterr().err
    with pytest.raises(AdaspecError, match="sends 3 requests but 2 prompts"):
        run_benchmark(BenchConfig(base_url="http://127.0.0.1:9", model="m", prompts=["a", "b"],
                                  load_phases=parse_phases("1x3"), progress=False))


def test_sweep_runs_every_arm_through_the_schedule_and_reports_phases(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SERVE_LOG", str(tmp_path / "calls.jsonl"))
    out = tmp_path / "moving"
    argv = ["bench", "sweep", "--model", "m0", "--arms", "none,fixed:3,adaptive:7", "--load-phases", "1x2,4x8,1x2",
            "--repeats", "2", "--num-warmups", "1", "--dataset", "random", "--tokenizer", "tiny", "--output-len", "8",
            "--out", str(out), "--disable-tqdm", "--startup-timeout", "30"]

    def sweep(extra=()):
        cfg = sweep_config_from_args(build_parser().parse_args(argv + list(extra)), log=print)
        cfg.launcher = [sys.executable, str(HERE / "fake_serve_main.py")]
        return run_sweep(cfg)

    res = sweep()
    names = sorted(p.name for p in (out / "points").glob("*.json"))
    assert names == sorted(f"{a}_phases_r{r}.json" for a in ("none", "fixed-3", "adaptive-7") for r in (0, 1))
    p = json.loads((out / "points" / "adaptive-7_phases_r1.json").read_text())
    assert p["complete"] and p["completed"] == 12 and p["load_phases"] == "1x2,4x8,1x2"
    assert [ph["num_requests"] for ph in p["phases"]] == [2, 8, 2]
    assert p["conditions"]["load_phases"] == "1x2,4x8,1x2" and p["conditions"]["num_prompts"] == 12
    # the fake server streams 2-token chunks for speculative arms, 1-token ones without: 4 chunks each
    assert p["total_output_tokens"] == 12 * 8 and p["phases"][1]["total_output_tokens"] == 8 * 8
    log = capsys.readouterr().out
    assert "phases 1x2,4x8,1x2 repeat 2/2" in log and "phase 1 (4x8)" in log
    md = res["report"]["markdown"]
    assert "## Whole run (mean ± sample std over 2 repeats)" in md
    assert "## Phase 1: concurrency 4 x 8 requests" in md and "## Phase 2: concurrency 1 x 2 requests" in md
    assert "- load phases (concurrency x requests, in order): `1x2,4x8,1x2`" in md
    assert "| `adaptive:7` |" in md and "The moving-load question" in md
    assert (out / "frontier.png").stat().st_size > 1000

    # resumes: nothing left to do; a changed schedule is refused with the setting named
    sweep()
    assert "all 2 points done, skipped" in capsys.readouterr().out
    argv[argv.index("--load-phases") + 1] = "1x2,8x8"
    with pytest.raises(AdaspecError, match="load_phases .*'1x2,4x8,1x2' -> '1x2,8x8'"):
        sweep()


def test_sweep_refuses_concurrency_with_phases(tmp_path, capsys):
    assert main(["bench", "sweep", "--model", "m", "--arms", "none", "--load-phases", "1x2", "--concurrency", "4",
                 "--out", str(tmp_path)]) == 2
    assert "drop --concurrency" in capsys.readouterr().err


def phased_point(arm, r, tput, speed, phases):
    return {"arm": arm, "concurrency": None, "repeat": r, "complete": True, "completed": 10, "failed": 0,
            "load_phases": "1x4,8x32", "output_throughput": tput, "median_per_user_tok_s": speed,
            "p90_per_user_tok_s": speed + 5, "median_ttft_ms": 20.0, "p99_ttft_ms": 40.0,
            "phases": [{"phase": i, "max_concurrency": c, "num_requests": n, "start_s": s0, "end_s": s1,
                        "output_throughput": t, "median_per_user_tok_s": v, "p90_per_user_tok_s": v + 1,
                        "median_ttft_ms": 10.0, "p99_ttft_ms": 30.0, "failed": 0}
                       for i, (c, n, s0, s1, t, v) in enumerate(phases)]}


def test_phase_report_tables_and_goal_on_known_numbers(tmp_path):
    pts = []
    for r in range(2):
        ph = lambda t1, v1, t2, v2: [(1, 4, 0.0, 2.0 + r, t1 + r, v1), (8, 32, 2.0 + r, 10.0, t2 + 10 * r, v2)]
        pts.append(phased_point("none", r, 100 + 10 * r, 50 + 2 * r, ph(40, 40, 300, 30)))
        pts.append(phased_point("fixed:7", r, 150 + 10 * r, 60 + 2 * r, ph(60, 60, 250, 20)))
        pts.append(phased_point("adaptive:7", r, 200 + 10 * r, 50 + 2 * r, ph(58, 58, 320, 30)))
        # the server's cost check over the run: [steps, priced ms, wall ms per step] by q
        pts[-1]["spec_cost_check"] = {"3": [2.0, 1.0 + r, 3.0 + 2 * r]}
    (tmp_path / "points").mkdir()
    for p in pts:
        (tmp_path / "points" / f"{p['arm'].replace(':', '-')}_phases_r{p['repeat']}.json").write_text(json.dumps(p))
    (tmp_path / "manifest.json").write_text(json.dumps({"arms": [{"name": a} for a in ("none", "fixed:7", "adaptive:7")]}))
    md = write_report(tmp_path)["markdown"]
    # whole run: mean ± sample std of (200, 210) = 205 ± 7.07; (50, 52) = 51 ± 1.41
    assert "| `adaptive:7` | 205.0 ± 7.07 | 51.0 ± 1.41 | 56.0 ± 1.41 | 20.0 ± 0.000 | 40.0 ± 0.000 |" in md
    assert "| `none` | 105.0 ± 7.07 | 51.0 ± 1.41 |" in md
    # phase 1 (8 x 32): throughput (320, 330) -> 325 ± 7.07 for adaptive, spans 2..3 s to 10 s
    assert "## Phase 1: concurrency 8 x 32 requests; from 2.50 s to 10.0 s" in md
    assert "| `adaptive:7` | 325.0 ± 7.07 | 30.0 ± 0.000 |" in md
    assert "| `fixed:7` | 60.5 ± 0.707 | 60.0 ± 0.000 |" in md  # phase 0
    # adaptive has more throughput than both beyond spread; as fast per user as none, slower than fixed:7
    assert "- **`adaptive:7` does not meet the goal**" in md
    assert "`none`: output throughput +95.2% (higher), median per-user speed +0.0% (within spread) -> beats it" in md
    assert "`fixed:7`: output throughput +32.3% (higher), median per-user speed -16.4% (lower) -> does not beat it" in md
    assert "burst" not in md
    # the repeats pooled, weighted by their steps: priced (2 x 1 + 2 x 2) / 4, measured (2 x 3 + 2 x 5) / 4
    assert "| adaptive:7 | whole run | 4: 1.50 -> 4.00 |" in md
    p0 = json.loads((tmp_path / "points" / "fixed-7_phases_r0.json").read_text())
    p0.update(burst_delivered_requests=3, completed=36)
    (tmp_path / "points" / "fixed-7_phases_r0.json").write_text(json.dumps(p0))
    md = write_report(tmp_path)["markdown"]
    assert "## Warnings" in md and "fixed:7 3 of " in md and "delivered in one burst" in md
    assert "CPU-bound" not in md
    p0.update(client_cpu_per_wall=0.97)
    (tmp_path / "points" / "fixed-7_phases_r0.json").write_text(json.dumps(p0))
    md = write_report(tmp_path)["markdown"]
    assert "the benchmark client was CPU-bound" in md and "fixed:7 0.97" in md
    # an arm a stopped sweep left with one repeat says so
    none_r1 = (tmp_path / "points" / "none_phases_r1.json").read_text()
    (tmp_path / "points" / "none_phases_r1.json").unlink()
    md = write_report(tmp_path)["markdown"]
    assert "| `none` (1 of 2 repeats) | 100.0 |" in md
    # without fixed:7 the goal is met on the means; against none's single repeat (no spread) no more
    for r in range(2):
        (tmp_path / "points" / f"fixed-7_phases_r{r}.json").unlink()
    md = write_report(tmp_path)["markdown"]
    assert "- **`adaptive:7` meets on the means only, not beyond spread, the goal**" in md and "| `fixed:7`" not in md
    assert "`none`: output throughput +105.0% (higher, spread unknown), median per-user speed +2.0% (higher, spread " \
           "unknown) -> beats it on the means only" in md
    assert "An arm with one repeat (a sweep stopped early) has no spread" in md
    (tmp_path / "points" / "none_phases_r1.json").write_text(none_r1)
    md = write_report(tmp_path)["markdown"]
    assert "- **`adaptive:7` meets the goal**" in md and "spread unknown" not in md


def test_report_refuses_a_mixture_of_phased_and_plain_points(tmp_path):
    (tmp_path / "points").mkdir()
    p = phased_point("none", 0, 1.0, 1.0, [(1, 4, 0.0, 1.0, 1.0, 1.0)])
    (tmp_path / "points" / "none_phases_r0.json").write_text(json.dumps(p))
    plain = {"arm": "none", "concurrency": 4, "repeat": 0, "complete": True, "completed": 1, "failed": 0,
             "output_throughput": 1.0, "median_per_user_tok_s": 1.0}
    (tmp_path / "points" / "none_c4_r0.json").write_text(json.dumps(plain))
    with pytest.raises(AdaspecError, match="mixes moving-load points"):
        write_report(tmp_path)


def test_summary_warns_of_burst_streams_and_a_busy_client(phased_result):
    from adaspec.bench.runner import format_summary

    quiet = dict(phased_result, burst_delivered_requests=0, client_cpu_per_wall=0.89)
    assert "WARNING" not in format_summary(quiet)
    loud = format_summary(dict(phased_result, burst_delivered_requests=3, client_cpu_per_wall=0.9))
    assert "WARNING: 3 streams were delivered in one burst" in loud
    assert "WARNING: the client was CPU-bound (0.90 CPU s per wall s)" in loud
