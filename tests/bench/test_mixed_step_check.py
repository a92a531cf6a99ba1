"""benchmarks/mixed_step_check.py: what the fused mode's rule (policy.mixed_step_drafts) decides
for a step with prompt chunks, under a sweep's cost tables and a pair's held-out curve."""
import json
import lzma

import pytest

from adaspec.testing import load_benchmark

# the adaptive-fused:7 arm's tables of H100 run 50 (code-0.6b pair, 256 graphs), every 2nd size
H100_RUN50 = {"verify": {"sizes": [1, 3, 6, 12, 24, 48, 96, 192, 384, 768, 1536, 2048],
                         "ms": [1.675, 1.750, 1.756, 1.835, 1.850, 2.009, 2.044, 2.265, 2.688, 3.956, 6.403, 8.151]},
              "draft": {"sizes": [1, 4, 8, 16, 32, 64, 128, 256],
                        "ms": [0.474, 0.490, 0.510, 0.535, 0.562, 0.633, 0.819, 1.256]}}
# a forward that costs a floor plus a price per token, whatever its size
LINEAR = {"verify": {"sizes": [1, 256, 2048, 4096], "ms": [2.02, 7.12, 42.96, 83.92]},
          "draft": {"sizes": [1, 256], "ms": [0.5, 0.5]}}
# a forward that steps up past 2,048 tokens (as a kernel's tile count or a graph's padding can)
STEP = {"verify": {"sizes": [1, 256, 512, 2048, 2049, 4096], "ms": [1.0, 1.2, 1.5, 3.0, 20.0, 25.0]},
        "draft": {"sizes": [1, 256], "ms": [0.4, 0.5]}}
PAIR = {"heldout": {"T=0": {"cond_acceptance": [0.92, 0.85, 0.82, 0.80, 0.82, 0.82, 0.84]},
                    "T=1": {"cond_acceptance": [0.79, 0.71, 0.66, 0.64, 0.62, 0.61, 0.60]}}}


@pytest.fixture(scope="module")
def check():
    return load_benchmark("mixed_step_check")


def _files(tmp_path, tables, xz=False):
    sweep = tmp_path / ("sweep.json.xz" if xz else "sweep.json")
    text = json.dumps({"cost_tables": {"adaptive-fused:7": tables}})
    if xz:
        with lzma.open(sweep, "wt") as f:
            f.write(text)
    else:
        sweep.write_text(text)
    pair = tmp_path / "pair.json"
    pair.write_text(json.dumps(PAIR))
    return sweep, pair


def _rows(check, tmp_path, tables, xz=False):
    sweep, pair = _files(tmp_path, tables, xz)
    out = tmp_path / "rows.json"
    assert check.main([str(sweep), "--pair", str(pair), "--json", str(out)]) == 0
    return json.loads(out.read_text())["rows"]


def test_run50s_tables_keep_every_chunk_step_plain(check, tmp_path, capsys):
    """H100 run 50: under its tables the rule drafted in no step with prompt chunks, at either
    temperature, 64 or 256 rows, 256-3072 prompt tokens; the terms printed are the rule's own
    (it drafts exactly where the gain beats ref x the extra time)."""
    rows = _rows(check, tmp_path, H100_RUN50, xz=True)
    assert len(rows) == 2 * 2 * 4 and not any(r["drafts"] for r in rows)
    assert all(r["drafts"] == (r["gain"] > r["ref_times_extra"]) for r in rows)
    # the break-even rate: the rule drafts exactly where the rate it values time at is below it
    assert all(r["drafts"] == (r["ref_tokens_per_ms"] < r["drafts_below_tokens_per_ms"]) for r in rows)
    assert all(r["t_draft_ms"] > r["t_plain_ms"] > 0 and r["budget"] > 0 for r in rows)
    assert "drafts=False" in capsys.readouterr().out


def test_with_linear_tables_the_rule_never_drafts_beside_chunks(check, tmp_path):
    """verify(n) = a + b n, a constant draft d: the rule drafts iff S / T > (a + d) / (b T) + B / T
    (S: the B* slots' expected accepted drafts, T = n: the decoding rows), which no S <= B meets.
    So the fused rule, with the chunks in a forward of their own, drafts beside chunks only where
    the tables' steps (graph padding) make verification cheaper than linear."""
    rows = _rows(check, tmp_path, LINEAR)
    assert rows and not any(r["drafts"] for r in rows)
    assert all(r["budget"] > 0 for r in rows)  # the decode-only objective itself drafts
    assert all(r["drafts"] == (r["gain"] > r["ref_times_extra"]) for r in rows)


def test_where_the_chunk_and_the_rows_together_cost_a_step_more_the_rule_drafts(check, tmp_path):
    """2,048 prompt tokens beside 256 rows cross the table's step (20 ms as one forward), while
    the chunk alone (3 ms) and a verify of the rows' drafts apart cost less: the rule drafts, and
    the terms printed agree with its verdict both ways."""
    sweep, pair = _files(tmp_path, STEP)
    out = tmp_path / "rows.json"
    assert check.main([str(sweep), "--pair", str(pair), "--requests", "256", "--prompt-tokens", "1024,2048",
                       "--json", str(out)]) == 0
    rows = {(r["temperature"], r["prompt_tokens"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows["T=0", 2048]["drafts"] and rows["T=1", 2048]["drafts"]
    assert not rows["T=0", 1024]["drafts"]
    assert all(r["drafts"] == (r["gain"] > r["ref_times_extra"]) for r in rows.values())


def test_the_break_even_overhead_is_where_the_rule_turns(check, tmp_path):
    """The overhead the table reports for each shape: priced with a little more the rule drafts,
    with a little less it does not (an overhead lowers the rate the extra time is valued at)."""
    import numpy as np
    from adaspec.spec_decode.cost_model import CostModel
    from adaspec.spec_decode.policy import mixed_step_drafts
    from adaspec.spec_decode.step_overhead import OverheadCost, StepOverhead

    rows = _rows(check, tmp_path, H100_RUN50)
    assert all(r["break_even_overhead_ms"] is not None and 0 < r["break_even_overhead_ms"] < 10 for r in rows)
    cost = check.padded_cost(CostModel.from_dict(H100_RUN50), check.capture_sizes(256), check.query_levels(7))
    for r in rows[:4] + rows[-4:]:
        grid = np.tile(np.cumprod(PAIR["heldout"][r["temperature"]]["cond_acceptance"]), (r["requests"], 1))

        def drafts(o):
            return mixed_step_drafts(grid, r["requests"], r["requests"], r["prompt_tokens"], r["requests"],
                                     OverheadCost(cost, StepOverhead(o)), True)[0]

        be = r["break_even_overhead_ms"]
        assert drafts(be) and not drafts(be - 0.011), r  # bisected to 0.01 ms, the drafting end kept
    assert all(r["break_even_overhead_ms"] == 0.0 for r in _rows(check, tmp_path, STEP) if r["drafts"])


def test_bad_input_is_named(check, tmp_path):
    sweep, pair = _files(tmp_path, H100_RUN50)
    with pytest.raises(SystemExit):
        check.main([str(sweep), "--pair", str(pair), "--arm", "adaptive:5"])
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        check.main([str(bare), "--pair", str(pair)])
