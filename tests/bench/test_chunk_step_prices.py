"""benchmarks/chunk_step_prices.py: drafting beside prompt chunks, its wall against its price, from
an offline sweep's step trace lined up with the no-spec arm's."""
import json

import pytest

from adaspec.testing import load_benchmark

FIELDS = ["wall_ms", "prompt_tokens", "generated_tokens", "running", "waiting", "drafted_rows", "verified_drafts",
          "draft_skipped", "mixed_fused"]
# a verify that costs 1 ms plus 0.01 ms a token, a draft of 0.5 ms plus 0.01 a row
TABLES = {"verify": {"sizes": [1, 4096], "ms": [1.01, 41.96]}, "draft": {"sizes": [1, 256], "ms": [0.51, 3.06]}}


def _step(wall, prompt, gen, running, drafted=0, verified=0):
    return [wall, prompt, gen, running, 0, drafted, verified, 0, 0]


def _sweep(tmp_path, trace_fields=True):
    base = [_step(2.0, 100, 0, 0), _step(40.0, 90, 4, 4), _step(41.0, 80, 8, 8), _step(42.0, 70, 8, 8),
            _step(5.0, 0, 8, 8), _step(5.0, 0, 8, 8)]
    arm = [_step(2.0, 100, 0, 0), _step(40.0, 90, 4, 4),  # not drafted: no extra
           _step(50.0, 80, 20, 8, drafted=8, verified=16),  # +9 ms, +12 tokens
           _step(47.0, 70, 14, 8, drafted=8, verified=8),  # +5 ms, +6 tokens
           _step(20.0, 5, 30, 8, drafted=8, verified=24),  # past the aligned prefix: not counted
           _step(9.0, 0, 8, 8)]
    rows = [dict(arm="none", concurrency=8, repeat=0, step_trace=base),
            dict(arm="adaptive:7", concurrency=8, repeat=0, step_trace=arm),
            dict(arm="adaptive:7", concurrency=16, repeat=0, step_trace=arm)]
    sweep = {"rows": rows, "cost_tables": {"adaptive:7": TABLES}}
    if trace_fields:
        sweep["step_trace_fields"] = FIELDS
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    return path


@pytest.fixture(scope="module")
def prices():
    return load_benchmark("chunk_step_prices")


def test_the_drafting_chunk_steps_of_the_aligned_prefix_against_their_price(prices, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert prices.main([str(_sweep(tmp_path)), "--concurrency", "8", "--max-num-seqs", "8", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["arm"] == "adaptive:7" and row["aligned_steps"] == 4 and row["drafting_chunk_steps"] == 2
    assert row["extra_wall_ms"] == pytest.approx(14.0) and row["extra_tokens"] == 18
    assert row["extra_tokens_per_ms"] == pytest.approx(18 / 14.0)
    # the baseline's decode-only steps at the full concurrency: 16 tokens in 10 ms
    assert row["baseline_decode_tokens_per_ms"] == pytest.approx(1.6)
    assert row["arm_decode_tokens_per_ms"] == pytest.approx(8 / 9.0)  # the arm's one such step
    # priced: per step draft(8) + verify(8 rows, 8 + B tokens, padded to the graphs) - verify(8 rows, 8 tokens)
    cost = prices.padded_cost(prices.CostModel.from_dict(TABLES), prices.capture_sizes(8),
                              prices.query_levels(7, every=True))
    want = prices.drafting_extra_ms(cost, 8, 16) + prices.drafting_extra_ms(cost, 8, 8)
    assert row["priced_extra_ms"] == pytest.approx(want)
    # 8 rows x Q = 3 pads 24 tokens to 24, Q = 2: 16; the draft 0.53 ms at 8 rows
    assert prices.drafting_extra_ms(cost, 8, 16) == pytest.approx(0.51 + 0.01 * 7 + 0.01 * 16, abs=1e-6)
    # the split, per step: the rows' own graphed forward (1 ms + 8 tokens) beside the chunks' (1 ms +
    # P tokens) against one forward of both (1 ms + 8 + P tokens): one forward's fixed 1 ms each
    assert row["split_ms"] == pytest.approx(2.0)
    assert prices.split_ms(cost, 8, 80) == pytest.approx(1.0)
    printed = capsys.readouterr().out
    assert "extra wall 14.0 ms" in printed and "split 2.0 ms" in printed


def test_a_sweep_without_a_step_trace_is_refused(prices, tmp_path):
    with pytest.raises(SystemExit, match="--step-trace"):
        prices.main([str(_sweep(tmp_path, trace_fields=False))])
