"""benchmarks/summarize_sweep.py: the offline frontier's tables, the share of time in steps with a
prefill chunk, and the server report's verdict per concurrency."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import summarize_sweep  # noqa: E402


def _row(arm, c, r, thr, user, prefill_steps=10, prefill_ms=5.0, duration=0.1):
    return {"arm": arm, "concurrency": c, "repeat": r, "output_throughput": thr, "median_user_speed": user,
            "mean_accepted_length": None, "duration": duration,
            "step_kinds": {"prefill": {"steps": prefill_steps, "ms_per_step": prefill_ms},
                           "decode": {"steps": 20, "ms_per_step": 2.5}}}


def test_prefill_share_and_the_verdict(tmp_path, capsys):
    # at C = 64: fixed:3 beats adaptive:7 on both axes beyond the spreads; at C = 256 they tie
    rows = [_row("fixed:3", 64, r, 1000 + 10 * r, 500 + r) for r in range(2)]
    rows += [_row("adaptive:7", 64, r, 900 + 10 * r, 480 + r, prefill_steps=16) for r in range(2)]
    rows += [_row("fixed:3", 256, r, 2000 + 100 * r, 200 + 5 * r) for r in range(2)]
    rows += [_row("adaptive:7", 256, r, 2010 + 100 * r, 199 + 5 * r) for r in range(2)]
    rows.append({"arm": "none", "concurrency": 64, "repeat": 0, "output_throughput": 800,
                 "median_user_speed": 400, "mean_accepted_length": None})  # no step kinds recorded
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"args": {}, "rows": rows}))
    summarize_sweep.main(str(p))
    out = capsys.readouterr().out
    # 10 steps of 5 ms in 0.1 s: half the point; 16 steps: 0.8
    assert "| 64 | 0.50 ± 0.00 | 0.80 ± 0.00 | – |" in out
    assert summarize_sweep.prefill_share(rows[0]) == 0.5 and summarize_sweep.prefill_share(rows[-1]) is None
    verdict = {line.split("**")[1]: line for line in out.splitlines() if line.startswith("- **C=")}
    assert "dominated beyond spread: `adaptive:7` (by `fixed:3`)." in verdict["C=64"]
    # none has one repeat: no spread, so worse on both axes but not "beyond spread"
    assert "Worse on both axes, spread unknown (a cell with fewer than 2 repeats): `none` (by `fixed:3`, " \
           "`adaptive:7`)." in verdict["C=64"]
    assert "dominated beyond spread: none." in verdict["C=256"]


def test_the_repeats_note_says_when_a_sweep_was_cut_short():
    """A sweep stopped in time ("partial") must not be labelled with the repeats it asked for."""
    full = [_row(a, c, r, 1, 1) for a in ("none", "fixed:3") for c in (1, 256) for r in range(3)]
    assert summarize_sweep.repeats_note({"args": {"repeats": 3}, "rows": full}) == "3 repeats"
    cut = [r for r in full if not (r["concurrency"] == 256 and r["repeat"] > 0)]
    doc = {"args": {"repeats": 3}, "rows": cut, "partial": True}
    assert summarize_sweep.repeats_note(doc) == "partial run: 1-3 of 3 repeats per point"
    uneven = {"args": {"repeats": 3}, "rows": cut}  # not flagged, but the cells still differ
    assert summarize_sweep.repeats_note(uneven) == "1-3 of 3 repeats per point"
    assert summarize_sweep.repeats_note({"args": {}, "rows": cut}) == "1-3 repeats per point"  # asked for: unrecorded


FIELDS = ["wall_ms", "prompt_tokens", "generated_tokens", "running", "waiting", "drafted_rows", "verified_drafts",
          "draft_skipped", "mixed_fused"]


def _traced(arm, steps):
    return {"arm": arm, "concurrency": 1, "repeat": 0, "output_throughput": 1, "median_user_speed": 1,
            "mean_accepted_length": None, "step_trace": steps}


def _summary(tmp_path, capsys, rows, fields=FIELDS) -> str:
    """summarize_sweep's output for a sweep of `rows` (fields None: a sweep without a step trace)."""
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"args": {}, "rows": rows, **({"step_trace_fields": fields} if fields else {})}))
    summarize_sweep.main(str(p))
    return capsys.readouterr().out


def test_decode_steps_that_drafted_from_the_step_trace(tmp_path, capsys):
    # [wall, prompt, generated, running, waiting, drafted rows, verified, skipped, fused]
    chunk = [9.0, 20, 1, 1, 0, 1, 3, 0, 0]  # carries a prompt chunk: not a decode-only step
    idle = [0.5, 0, 0, 0, 0, 0, 0, 0, 0]  # emitted nothing
    steps = [chunk, idle, [2.0, 0, 3, 1, 0, 1, 6, 0, 0], [1.0, 0, 1, 1, 0, 0, 0, 1, 0],
             [3.0, 0, 4, 1, 0, 1, 6, 0, 0], [1.0, 0, 1, 1, 0, 0, 0, 1, 0]]
    share, ms = summarize_sweep.decode_steps({**_traced("a", steps), "step_trace_fields": FIELDS})
    assert share == 0.5 and ms == 2.5
    plain = [[1.0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert summarize_sweep.decode_steps({**_traced("n", plain), "step_trace_fields": FIELDS}) == (0.0, None)
    assert summarize_sweep.decode_steps(_traced("a", steps)) is None  # no fields: nothing to read
    out = _summary(tmp_path, capsys, [_traced("a", steps), _traced("n", plain)])
    assert "share of the decode-only steps that drafted" in out and "| 1 | 0.50 ± 0.00 | 0.00 ± 0.00 |" in out
    assert "| 1 | 2.50 ± 0.00 | – |" in out
    assert "decode-only" not in _summary(tmp_path, capsys, [_traced("a", steps)], fields=None)  # untraced sweep


def test_plain_steps_and_chunk_steps_from_the_step_trace(tmp_path, capsys):
    """What a speculative arm's plain decode-only steps and its steps with prompt chunks cost,
    beside no-spec's: where a gap to no-spec lies (H100 run 63's Qwen3-8B shape at 256 requests)."""
    # [wall, prompt, generated, running, waiting, drafted rows, verified, skipped, fused]
    steps = [[9.0, 2000, 1, 1, 0, 0, 0, 0, 0], [3.0, 1000, 2, 2, 0, 1, 3, 0, 0],  # chunks: 12 ms / 3k
             [0.5, 0, 0, 0, 0, 0, 0, 0, 0],  # emitted nothing: neither kind
             [2.0, 0, 3, 1, 0, 1, 6, 0, 0], [1.0, 0, 1, 1, 0, 0, 0, 1, 0], [1.5, 0, 1, 1, 0, 0, 0, 1, 0]]
    plain, per_k = summarize_sweep.plain_and_chunk_costs({**_traced("a", steps), "step_trace_fields": FIELDS})
    assert plain == 1.25 and per_k == 4.0
    decode_only = [[1.0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert summarize_sweep.plain_and_chunk_costs({**_traced("n", decode_only), "step_trace_fields": FIELDS}) \
        == (1.0, None)
    assert summarize_sweep.plain_and_chunk_costs(_traced("a", steps)) is None  # no fields: nothing to read
    out = _summary(tmp_path, capsys, [_traced("a", steps), _traced("n", decode_only)])
    assert "ms per decode-only step that did not draft" in out and "| 1 | 1.25 ± 0.00 | 1.00 ± 0.00 |" in out
    assert "per 1,000 prompt tokens" in out and "| 1 | 4.00 ± 0.00 | – |" in out


def test_steady_plain_steps_from_the_step_trace(tmp_path, capsys):
    """A plain decode-only step's price, from the plain steps with every request running whose
    neighbours are such steps too: a step call next to a chunk, a drafting step or a shorter batch
    carries other work's wait (H100 run 63's 8B shape: +1.5% that the mean over all plain steps hid)."""
    # [wall, prompt, generated, running, waiting, drafted rows, verified, skipped, fused]
    def p(ms, running=2):
        return [ms, 0, running, running, 0, 0, 0, 1, 0]
    chunk, drafting = [9.0, 500, 2, 2, 0, 0, 0, 0, 0], [3.0, 0, 6, 2, 0, 2, 6, 0, 0]
    steps = [chunk, p(5.0), p(1.0), p(1.2), p(1.1), drafting, p(4.0), p(2.0), p(1.3),
             p(0.5, running=1), p(0.6, running=1), p(0.7, running=1), p(0.8, running=1)]
    # steady: 1.0, 1.2 and 2.0 (median 1.2, mean 1.4); not 5.0 (after the chunk), 1.1 (before the
    # drafting step), 4.0 (after it), 1.3 (before a step with one request running) or the
    # one-request steps themselves
    row = {**_traced("a", steps), "concurrency": 2, "step_trace_fields": FIELDS}
    assert summarize_sweep.steady_plain_ms(row) == 1.2
    assert summarize_sweep.steady_plain_ms({**row, "step_trace": [chunk, p(1.0), drafting]}) is None
    assert summarize_sweep.steady_plain_ms(_traced("a", steps)) is None  # no fields: nothing to read
    out = _summary(tmp_path, capsys, [{**_traced("a", steps), "concurrency": 2}])
    assert "ms per steady plain step" in out and "| 2 | 1.20 ± 0.00 |" in out


def test_first_wave_and_chunk_steps_from_the_step_trace(tmp_path, capsys):
    """The first wave's time (the steps before the first decode-only one, timed by the calls that
    wait for them: one call later), the count of steps with a prompt chunk and their mean prompt
    tokens: a speculative arm's extra, smaller chunk steps against no-spec's (H100 run 63, 8B)."""
    # [wall, prompt, generated, running, waiting, drafted rows, verified, skipped, fused]
    steps = [[0.5, 300, 0, 2, 1, 0, 0, 0, 0], [8.0, 100, 2, 3, 0, 0, 0, 0, 0],  # the first wave
             [6.0, 0, 3, 3, 0, 0, 0, 0, 0],  # first decode-only step: its call waits for the wave's last
             [1.0, 0, 3, 3, 0, 0, 0, 0, 0], [2.0, 50, 3, 3, 0, 0, 0, 0, 0], [1.0, 0, 3, 3, 0, 0, 0, 0, 0]]
    row = {**_traced("a", steps), "step_trace_fields": FIELDS}
    assert summarize_sweep.chunk_steps(row) == (14.0, 3, 150.0)
    prefill_only = [[0.5, 300, 0, 2, 1, 0, 0, 0, 0], [8.0, 100, 2, 3, 0, 0, 0, 0, 0]]
    assert summarize_sweep.chunk_steps({**row, "step_trace": prefill_only}) == (None, 2, 200.0)
    assert summarize_sweep.chunk_steps(_traced("a", steps)) is None  # no fields: nothing to read
    out = _summary(tmp_path, capsys, [_traced("a", steps)])
    assert "ms of the first wave's steps" in out and "| 1 | 14.0 ± 0.0 |" in out
    assert "steps with a prompt chunk (step trace)" in out and "| 1 | 3.0 ± 0.0 |" in out
    assert "| 1 | 150 ± 0 |" in out


def test_the_full_batch_decode_rate_is_tabled_where_points_record_it(tmp_path, capsys):
    """step_kinds decode_full_batch (the decode-only steps that began with the batch full): its
    tokens per ms get a table of their own, mean ± std over the repeats; points without it show –."""
    rows = [_row("fixed:3", 64, r, 1000, 500) for r in range(2)]
    for r, rate in zip(rows, (70.0, 72.0)):
        r["step_kinds"]["decode_full_batch"] = {"steps": 5, "ms_per_step": 3.0, "tokens": 1000, "tokens_per_ms": rate}
    rows.append(_row("none", 64, 0, 800, 400))  # an older sweep's point: no decode_full_batch
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"args": {}, "rows": rows}))
    summarize_sweep.main(str(p))
    out = capsys.readouterr().out
    assert "tokens per ms of the decode-only steps that began with the batch full" in out
    assert "| 64 | 71.0 ± 1.4 | – |" in out
    assert summarize_sweep.full_batch_rate(rows[-1]) is None


def test_preemptions_get_a_table_only_where_a_point_had_some(tmp_path, capsys):
    rows = [_row("fixed:3", 64, r, 1000, 500) for r in range(2)] + [_row("none", 64, 0, 800, 400)]
    p = tmp_path / "sweep.json"
    for r in rows:
        r["preemptions"] = 0
    p.write_text(json.dumps({"args": {}, "rows": rows}))
    summarize_sweep.main(str(p))
    assert "requests preempted" not in capsys.readouterr().out
    rows[0]["preemptions"], rows[1]["preemptions"] = 3, 5
    p.write_text(json.dumps({"args": {}, "rows": rows}))
    summarize_sweep.main(str(p))
    out = capsys.readouterr().out
    assert "requests preempted" in out and "| 64 | 4.0 ± 1.4 | 0.0 ± 0.0 |" in out


def test_each_output_length_condition_is_a_frontier_of_its_own(tmp_path, capsys):
    """A sweep over --random-range-ratio 0,0.5: a section per ratio, each with its own tables, verdict
    and PNG; rows of one ratio never enter the other's cells."""
    rows = []
    for ratio, (thr_a, thr_b) in ((0.0, (1000, 900)), (0.5, (700, 800))):
        for r in range(2):
            rows.append({**_row("fixed:3", 64, r, thr_a + r, 500 + r), "random_range_ratio": ratio})
            rows.append({**_row("adaptive:7", 64, r, thr_b + r, 480 + r), "random_range_ratio": ratio})
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"args": {"repeats": 2, "random_range_ratio": [0.0, 0.5]}, "rows": rows}))
    png = tmp_path / "frontier.png"
    summarize_sweep.main(str(p), str(png))
    out = capsys.readouterr().out
    first, second = out.split("## output lengths with range ratio 0.5")
    assert "## output lengths with range ratio 0" in first
    assert "| 64 | 1000 ± 1 | 900 ± 1 |" in first and "| 64 | 700 ± 1 | 800 ± 1 |" in second
    assert "2 repeats" in first and "2 repeats" in second
    assert "`adaptive:7` (by `fixed:3`)" in first and "`fixed:3` (by `adaptive:7`)" not in first
    assert (tmp_path / "frontier_rr0.png").exists() and (tmp_path / "frontier_rr0.5.png").exists()
    assert not png.exists()
