"""A synthetic-acceptance run is labelled end to end: engine stats -> /metrics -> the bench result
JSON -> the sweep's point -> the report and the plot title (the embedded tiny target, in process)."""
import json
import os
import sys

import pytest

from adaspec.bench import report as report_mod
from adaspec.bench.runner import BenchConfig, format_summary, run_benchmark
from adaspec.bench.specstats import parse_spec_counters, spec_delta
from adaspec.cli import main

SERVE_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve")
LABEL = "synthetic acceptance: timing only"
SPEC = {"method": "synthetic", "synthetic_acceptance": [0.6, 0.5, 0.7], "num_speculative_tokens": 3,
        "draft_sample_method": "greedy"}


@pytest.fixture(scope="module")
def synthetic_server():
    from adaspec.config import EngineConfig
    from adaspec.engine.llm_engine import LLMEngine

    sys.path.insert(0, SERVE_TESTS)
    try:
        from live_server import LiveServer
    finally:
        sys.path.remove(SERVE_TESTS)
    server = LiveServer(lambda: LLMEngine(EngineConfig("tiny", max_num_seqs=4, speculative_config=SPEC)),
                        names=["tiny"], max_queue=64)
    yield server.url
    server.close()


def test_bench_result_and_summary_carry_the_label(synthetic_server):
    res = run_benchmark(BenchConfig(base_url=synthetic_server, model="tiny", prompts=["def f(x):", "import os"],
                                    max_concurrency=2, output_len=12, ignore_eos=True, temperature=0,
                                    num_warmups=1, progress=False))
    assert res["completed"] == 2 and res["failed"] == 0, res["errors"]
    assert res["spec_synthetic_acceptance"] == LABEL
    assert res["spec_num_drafts"]
    assert format_summary(res).splitlines()[1].startswith(f"NOTE: {LABEL}")


def test_sweep_point_report_and_plot_title_carry_the_label(synthetic_server, tmp_path, monkeypatch):
    titles = []
    real_plot = report_mod.plot_frontier
    monkeypatch.setattr(report_mod, "plot_frontier",
                        lambda cells, arms, path, title="": titles.append(title) or real_plot(cells, arms, path, title))
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--model", "tiny", "--base-url", f"fixed:3={synthetic_server}",
                 "--concurrency", "2", "--repeats", "1", "--num-prompts", "2", "--num-warmups", "0",
                 "--dataset", "random", "--random-input-len", "8", "--output-len", "8", "--ignore-eos",
                 "--temperature", "0", "--out", str(out), "--disable-tqdm"]) == 0
    point = json.loads((out / "points" / "fixed-3_c2_r0.json").read_text())
    assert point["spec_synthetic_acceptance"] == LABEL
    md = (out / "report.md").read_text()
    assert md.splitlines()[2].startswith(f"**{LABEL}.** Arm `fixed:3` drew draft acceptance from a configured curve")
    assert titles and LABEL in titles[-1]


def test_report_marks_arms_configured_synthetic_and_only_them():
    def point(arm, spec, note=None):
        return {"arm": arm, "spec_synthetic_acceptance": note,
                "conditions": {"arm": {"name": arm, "speculative_config": spec}}}

    pts = [point("none", None), point("fixed:7", {"method": "synthetic"}), point("adaptive:7", {"method": "dspark"})]
    assert report_mod.synthetic_arms(pts) == {"fixed:7": LABEL}
    assert report_mod.synthetic_arms([point("none", None), point("fixed:7", {"method": "dspark"})]) == {}
    assert report_mod.synthetic_banner({}) == []


def test_metrics_without_the_gauge_say_nothing():
    real = "adaspec:spec_decode_num_drafts_total{model_name=\"m\"} 4.0\n"
    synth = real + f"adaspec:spec_decode_synthetic_acceptance{{model_name=\"m\",note=\"{LABEL}\"}} 1.0\n"
    assert spec_delta(parse_spec_counters(real), parse_spec_counters(real))["spec_synthetic_acceptance"] is None
    assert spec_delta(parse_spec_counters(real), parse_spec_counters(synth))["spec_synthetic_acceptance"] == LABEL


@pytest.mark.slow
def test_sweep_with_synthetic_arms_through_real_adaspec_serve(tmp_path):
    """--speculative-config-extra makes the sweep's own `adaspec serve` processes synthetic; the no-spec
    arm stays a plain server without the label, and the report names only the synthetic arm."""
    out = tmp_path / "sweep"
    extra = json.dumps({"method": "synthetic", "synthetic_acceptance": [0.6, 0.5, 0.7]})
    assert main(["bench", "sweep", "--model", "tiny", "--arms", "none,fixed:3", "--speculative-config-extra", extra,
                 "--concurrency", "2", "--repeats", "1", "--num-prompts", "2", "--num-warmups", "1",
                 "--dataset", "random", "--random-input-len", "8", "--output-len", "8", "--ignore-eos",
                 "--out", str(out), "--disable-tqdm", "--startup-timeout", "300"]) == 0
    none = json.loads((out / "points" / "none_c2_r0.json").read_text())
    spec = json.loads((out / "points" / "fixed-3_c2_r0.json").read_text())
    assert none["spec_synthetic_acceptance"] is None and none["conditions"]["arm"]["speculative_config"] is None
    assert spec["spec_synthetic_acceptance"] == LABEL and spec["spec_num_drafts"]
    assert spec["conditions"]["arm"]["speculative_config"]["method"] == "synthetic"
    assert f"**{LABEL}.** Arm `fixed:3` drew" in (out / "report.md").read_text()
