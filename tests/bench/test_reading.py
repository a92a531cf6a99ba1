"""The demo's reading: computed from the sweep's cells and the cached cost tables, never canned."""
import json

from adaspec.bench.aggregate import Cell
from adaspec.bench.reading import edge_arms, find_cost_model, max_num_seqs_of, reading_lines, step_cost_from_speeds


def cell(arm, c, x, y, L=None):
    mean = {"median_per_user_tok_s": x, "output_throughput": y, "spec_mean_accepted_length": L}
    return Cell(arm, c, n=1, mean=mean, std={k: 0.0 for k in mean})


def cells(v_spec=20.0, L=2.5):
    return {
        ("none", 1): cell("none", 1, 40.0, 40.0),
        ("fixed:7", 1): cell("fixed:7", 1, v_spec, v_spec, L),
        ("none", 4): cell("none", 4, 30.0, 120.0),
        ("fixed:7", 4): cell("fixed:7", 4, 35.0, 100.0, 3.0),
    }


def test_edge_per_concurrency():
    # C=1: none beats fixed:7 on both axes; C=4: a trade-off, both on the edge
    assert edge_arms(cells()) == {1: ["none"], 4: ["none", "fixed:7"]}


def test_step_cost_from_speeds():
    x = step_cost_from_speeds(cells(), "fixed:7", 1)
    assert x["steps"] == 2.5 * 40 / 20  # L * v_none / v_spec
    assert step_cost_from_speeds(cells(), "adaptive:7", 1) is None


def _write_cost_model(d, model="m", k=7, drafter="dr"):
    d.mkdir(parents=True, exist_ok=True)
    doc = {"format": 1, "key": {"model": model, "k": k, "drafter": drafter, "max_num_seqs": 2},
           "model": {"verify": {"sizes": [1, 4, 8, 32], "ms": [4.0, 8.0, 10.0, 20.0], "capture_limit": None},
                     "draft": {"sizes": [1, 4], "ms": [6.0, 12.0], "capture_limit": None}}}
    (d / f"cost_model_{model}_{k}.json").write_text(json.dumps(doc))


def test_reading_lines_from_data(tmp_path):
    _write_cost_model(tmp_path / "cm")
    _write_cost_model(tmp_path / "cm", model="other")
    bm = tmp_path / "BENCHMARKS.md"
    bm.write_text("# Figures\n## CPU thing\n## A pair built (H100 run 4)\n## GPU, offline engine (H200)\n"
                  "### GPU tests\n" + "".join(f"## H200 run {n}\n" for n in range(3, 0, -1)))
    text = "\n".join(reading_lines(cells(), ["none", "fixed:7"], "m", "dr", tmp_path / "cm", bm))
    assert "C=1: `none`; C=4: `none`, `fixed:7`" in text
    assert "C=1: 5.00 target steps for 2.50 tokens" in text and "C=4: 2.57 target steps for 3.00 tokens" in text
    assert "it paid at C=4" in text
    # R=1: draft 6 ms vs target step 4 ms -> 1.50 x; verify of 8 tokens 10 ms; break-even (6+10)/4 = 4.00
    assert "R=1: draft 6.00 ms = 1.50 x a target step (4.00 ms), verify of 1 x 8 tokens 10.00 ms; " \
           "break-even at 4.00 accepted tokens per step" in text
    # R=4: draft 12 vs 8 -> 1.50 x; verify 32 tokens 20 ms; (12+20)/8 = 4.00
    assert "R=4: draft 12.00 ms = 1.50 x a target step (8.00 ms)" in text
    assert "Measured mean accepted length of `fixed:7`: C=1: 2.50; C=4: 3.00; below the break-even everywhere" in text
    # the newest GPU runs (second-level sections), the rest counted; no subsection, no CPU section
    # (a section naming its card only counts: the H100's as the H200's)
    assert '"A pair built (H100 run 4)"; "GPU, offline engine (H200)"; "H200 run 3"; and 2 earlier GPU runs' in text
    assert "CPU thing" not in text and "GPU tests" not in text and "run 1" not in text
    # other numbers, other reading
    slow = "\n".join(reading_lines(cells(v_spec=10.0), ["none", "fixed:7"], None))
    assert "C=1: 10.00 target steps" in slow and "Profiled" not in slow
    # an adaptive arm mixes drafted and plain steps: only its speed relative to none is stated
    ad = {("adaptive:7" if a == "fixed:7" else a, c): v for (a, c), v in cells().items()}
    text = "\n".join(reading_lines(ad, ["none", "adaptive:7"], None))
    assert "per-user speed relative to `none`, C=1: 0.50 x; C=4: 1.17 x" in text


def test_find_cost_model_matches_key(tmp_path):
    _write_cost_model(tmp_path, k=3)
    assert find_cost_model("m", 7, cache_dir=tmp_path) is None
    assert find_cost_model("m", 3, "dr", tmp_path)[1].draft_ms(1) == 6.0
    assert find_cost_model("m", 3, "other-drafter", tmp_path) is None
    assert find_cost_model("m", 3, cache_dir=tmp_path, max_num_seqs=4) is None  # profiled for another server size
    assert max_num_seqs_of(["--x", "--max-num-seqs=16"]) == 16 and max_num_seqs_of(["--max-num-seqs", "4"]) == 4
    assert max_num_seqs_of(["--max-model-len=9"]) is None
    (tmp_path / "cost_model_broken.json").write_text("{")
    assert find_cost_model("m", 3, cache_dir=tmp_path) is not None
