"""Cost tables: monotone, lookup rules, grids, profiling, disk cache keyed and never trusted blindly."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaspec.spec_decode.cost_model import (CostModel, CostTable, cache_path, default_cache_key, draft_grid,
                                     graph_rows_grid, load_or_profile, plot_cost_model, profile, verify_grid)


def test_forced_non_decreasing_with_running_max():
    t = CostTable([8, 1, 4, 2], [3.0, 1.0, 2.0, 2.5])  # unsorted input, noisy dip at 4
    assert t.sizes.tolist() == [1, 2, 4, 8] and t.ms.tolist() == [1.0, 2.5, 2.5, 3.0]


def test_step_below_limit_interpolation_above_extrapolation_past_end():
    t = CostTable([1, 2, 4, 8, 12, 16, 32], [1.0, 1.0, 2.0, 3.0, 6.0, 7.0, 11.0], capture_limit=8)
    # at or below the limit: the smallest profiled size >= n (padding is paid)
    assert [t.lookup(n) for n in (1, 2, 3, 4, 5, 7, 8)] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0]
    # above: interpolation between points above the limit only
    assert t.lookup(14) == pytest.approx(6.5) and t.lookup(24) == pytest.approx(9.0)
    # between the limit and the first point above it: the first segment extended back,
    # never an interpolation towards the graph cost at 8 (3.0 -> 6.0 would give 4.5 at 10)
    assert t.lookup(10) == pytest.approx(5.5)
    # past the last point: extrapolation of the last segment
    assert t.lookup(48) == pytest.approx(15.0)
    assert t.lookup(0) == 0.0
    arr = t.lookup(np.array([3, 14, 48]))
    assert isinstance(arr, np.ndarray) and arr.tolist() == pytest.approx([2.0, 6.5, 15.0])


def test_back_extension_never_drops_below_the_limit_cost():
    t = CostTable([4, 8, 16], [1.0, 5.0, 100.0], capture_limit=4)
    # the steep segment 8->16 extended back to 5 would go below the graph cost at 4: clamped
    assert t.lookup(5) == pytest.approx(1.0) and t.lookup(6) <= t.lookup(7) <= t.lookup(8) == 5.0


def test_no_capture_limit_interpolates_everywhere():
    t = CostTable([1, 2, 4, 8], [1.0, 2.0, 2.0, 4.0])
    assert t.lookup(3) == pytest.approx(2.0) and t.lookup(6) == pytest.approx(3.0)
    assert t.lookup(16) == pytest.approx(8.0) and t.lookup(0.5) == pytest.approx(1.0)


@settings(max_examples=80, deadline=None)
@given(st.sets(st.integers(1, 300), min_size=1, max_size=10), st.data())
def test_lookup_is_monotone_for_any_table(sizes, data):
    sizes = sorted(sizes)
    ms = data.draw(st.lists(st.floats(0.0, 50.0), min_size=len(sizes), max_size=len(sizes)))
    lim = data.draw(st.one_of(st.none(), st.sampled_from(sizes), st.integers(1, 400)))
    t = CostTable(sizes, ms, lim)
    ys = t.lookup(np.arange(0, 700))
    assert (np.diff(ys) >= -1e-9).all() and np.isfinite(ys).all()
    # the dense integer fast path, scalar lookups and float lookups agree
    assert np.allclose(ys, [t.lookup(int(n)) for n in range(700)])
    assert np.allclose(ys, t.lookup(np.arange(0, 700, dtype=np.float64)))
    # profiled points are reproduced at or below the limit (and everywhere without one)
    for s, m in zip(t.sizes, t.ms):
        if lim is None or s <= lim:
            assert t.lookup(int(s)) == pytest.approx(m)


def test_invalid_tables_are_refused():
    for sizes, ms in (([], []), ([1, 1], [1.0, 2.0]), ([0], [1.0]), ([1], [float("nan")]), ([1, 2], [1.0])):
        with pytest.raises(ValueError):
            CostTable(sizes, ms)


def test_grids():
    caps = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert verify_grid(4096, caps) == caps + [768, 1536, 3072, 4096]
    assert draft_grid(256, [1, 2, 4, 8]) == [1, 2, 4, 8, 12, 24, 48, 96, 192, 256]
    g = verify_grid(100)
    assert g[0] == 1 and g[-1] == 100 and g == sorted(set(g))
    assert all(b / a <= 2 for a, b in zip(g, g[1:]))
    assert verify_grid(4, [8, 16]) == [1, 2, 3, 4]  # captures above the maximum are ignored


def test_profile_spreads_each_shapes_runs_over_the_whole_profile():
    # every shape costs 2 ms, but the device slows down steadily while the tables are timed (clocks,
    # temperature): timed shape after shape, the later shapes would price higher (the policy decides
    # on differences of ~0.1 ms); in rounds over the shapes, each shape's median sees the same drift
    clock = {"t": 0.0, "calls": 0}

    def fn(n):
        clock["t"] += (2.0 + 0.01 * clock["calls"]) / 1e3
        clock["calls"] += 1

    m = profile(fn, None, [1, 2, 4, 8], [1], repeats=9, warmup=1, timer=lambda: clock["t"])
    assert clock["calls"] == 4 * 10
    ms = m.verify.ms
    # one round is 4 calls: shapes timed in the same round differ by at most 3 calls' drift
    assert ms[-1] - ms[0] <= 3 * 0.01 + 1e-9


def test_profile_takes_median_and_syncs():
    clock = {"t": 0.0, "calls": 0, "syncs": 0}
    # per shape: the first call is the warm-up, then five timed runs (ms per token)
    durations = {1: iter([9.0, 1.0, 2.0, 30.0, 3.0, 2.5]), 2: iter([9.0, 3.0, 3.5, 1.0, 40.0, 3.0])}

    def timer():
        return clock["t"]

    def fn(n):
        clock["t"] += next(durations[n]) / 1e3 * n
        clock["calls"] += 1

    def sync():
        clock["syncs"] += 1

    m = profile(fn, None, [1, 2], [1], repeats=5, warmup=1, timer=timer, sync=sync, verify_capture_limit=2)
    assert clock["calls"] == 12 and clock["syncs"] == 20
    assert m.verify.ms.tolist() == pytest.approx([2.5, 2 * 3.0]) and m.verify.capture_limit == 2
    assert m.draft_ms(5) == 0.0


def _model(scale=1.0):
    return CostModel(CostTable([1, 2, 4], [1.0 * scale, 2.0, 3.0], 2), CostTable([1, 8], [0.5, 0.9]))


def test_cache_hits_keys_and_invalidation(tmp_path):
    calls = []

    def prof(scale):
        return lambda: calls.append(scale) or _model(scale)

    key = default_cache_key(model="tiny", drafter="tiny-dspark", dtype="float32", device="cpu", max_tokens=64)
    assert "adaspec_version" in key
    m1 = load_or_profile(tmp_path, key, prof(1.0))
    m2 = load_or_profile(tmp_path, key, prof(0.1))  # cached: not re-profiled
    assert calls == [1.0] and m2.to_dict() == m1.to_dict()
    doc = json.loads(open(cache_path(tmp_path, key)).read())
    assert doc["key"]["model"] == "tiny"  # the key is stored inside the file too
    key2 = dict(key, max_tokens=128)  # any key change: new file, new profile
    load_or_profile(tmp_path, key2, prof(0.5))
    assert calls == [1.0, 0.5] and cache_path(tmp_path, key2) != cache_path(tmp_path, key)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 1, "key": {}, "model": {}}),
                                     json.dumps({"format": 99}), "",
                                     "STALE", "BADTABLE"])
def test_corrupt_or_stale_cache_is_ignored_with_a_warning(tmp_path, content):
    key = {"model": "tiny", "n": 1}
    path = cache_path(tmp_path, key)
    good = {"format": 1, "key": key, "model": _model().to_dict()}
    if content == "STALE":  # right file name, wrong key inside (e.g. a hash collision or edit)
        content = json.dumps(dict(good, key={"model": "other"}))
    if content == "BADTABLE":
        bad = _model().to_dict()
        bad["verify"]["ms"] = [1.0, "x", 3.0]
        content = json.dumps(dict(good, model=bad))
    with open(path, "w") as f:
        f.write(content)
    with pytest.warns(RuntimeWarning, match="ignoring cost-model cache"):
        m = load_or_profile(tmp_path, key, lambda: _model(0.25))
    assert m.verify.ms[0] == 0.25
    assert load_or_profile(tmp_path, key, lambda: pytest.fail("re-profiled")).verify.ms[0] == 0.25


def test_describe_and_plot(tmp_path):
    m = _model()
    assert "verify cost" in m.describe() and "draft cost" in m.describe()
    out = tmp_path / "cost.png"
    plot_cost_model(m, out)
    assert out.stat().st_size > 1000


def test_profile_times_every_narrow_width_over_the_draft_grid():
    """adaptive_draft_width "budget": each width below k gets its own table, timed by the width's
    own draft function (here a fake clock: w slots cost w ms per request)."""
    clock = {"t": 0.0}
    seen = []

    def draft_width(n, w):
        seen.append((n, w))
        clock["t"] += w * n / 1e3

    m = profile(lambda n: None, lambda n: draft_width(n, 7), [1], [1, 4], repeats=2, warmup=1,
                timer=lambda: clock["t"], fn_draft_width=draft_width, narrow_widths=[4, 2])
    assert sorted(m.draft_narrow) == [2, 4] and sorted(set(seen)) == [(1, 2), (1, 4), (1, 7), (4, 2), (4, 4), (4, 7)]
    assert m.draft_narrow[2].ms.tolist() == pytest.approx([2.0, 8.0]) and m.draft.ms.tolist() == pytest.approx([7.0, 28.0])
    assert m.draft_ms_width(4, [0, 1, 2, 3, 4, 5, 7]).tolist() == pytest.approx([8, 8, 8, 16, 16, 28, 28])
    with pytest.raises(ValueError, match="narrow_widths given without fn_draft_width"):
        profile(lambda n: None, lambda n: None, [1], [1], narrow_widths=[2])


def test_narrow_tables_round_trip_and_old_files_still_load(tmp_path):
    m = CostModel(_model().verify, _model().draft, {2: CostTable([1, 8], [0.1, 0.2]), 4: CostTable([1, 8], [0.3, 0.4])})
    back = CostModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert sorted(back.draft_narrow) == [2, 4] and back.draft_narrow[4].ms.tolist() == [0.3, 0.4]
    assert "draft of 2 slots cost" in m.describe()
    old = _model().to_dict()
    assert "draft_narrow" not in old and CostModel.from_dict(old).draft_narrow == {}
    assert CostModel.from_dict(old).draft_ms_width(8, [0, 7]).tolist() == [0.9, 0.9]  # every width as the full one
    with pytest.raises(ValueError, match="draft widths must be >= 1"):
        CostModel.from_dict({**old, "draft_narrow": {"0": {"sizes": [1], "ms": [0.1]}}})
    plot_cost_model(m, tmp_path / "narrow.png")
    assert (tmp_path / "narrow.png").stat().st_size > 1000


def test_graph_rows_grid_keeps_the_small_sizes_the_largest_and_a_ladder_between():
    from adaspec.engine.cuda_graphs import capture_sizes

    assert graph_rows_grid(capture_sizes(128)) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert graph_rows_grid([1, 2, 4, 6]) == [1, 2, 4, 6]
    for caps in ([3, 40, 41, 200], capture_sizes(256), capture_sizes(100), [5]):
        grid = graph_rows_grid(caps)
        assert set(grid) <= set(caps) and grid[-1] == max(caps) and grid == sorted(set(grid))
    for caps in (capture_sizes(256), capture_sizes(100), capture_sizes(1000)):  # every eighth size
        grid = graph_rows_grid(caps)
        assert all(b / a <= 2.0 for a, b in zip(grid, grid[1:]))  # no wide gap to interpolate over
        assert len(grid) < len(caps) / 2 or len(caps) < 20
    assert graph_rows_grid([]) == []


def test_profile_times_every_verify_graph_in_rounds_into_tables_by_level():
    """fn_verify_graph(rows, q) for every shape: one table per query level, by rows, each entry the
    median of its runs (a fake clock: a graph costs 1 ms + 0.1 ms a row + 0.01 ms a token)."""
    clock = {"t": 0.0}
    seen = []

    def graph(b, q):
        seen.append((b, q))
        clock["t"] += (1.0 + 0.1 * b + 0.01 * b * q) / 1e3

    shapes = [(b, q) for b in (1, 8, 16) for q in (1, 4, 8)]
    m = profile(lambda n: None, lambda n: None, [1], [1], repeats=3, warmup=1, timer=lambda: clock["t"],
                fn_verify_graph=graph, graph_shapes=shapes)
    assert len(seen) == len(shapes) * 4 and seen[:len(shapes)] == shapes  # warm-ups, then rounds
    assert sorted(m.verify_graph) == [1, 4, 8]
    assert m.verify_graph[4].sizes.tolist() == [1, 8, 16]
    assert m.verify_graph[4].ms.tolist() == pytest.approx([1.14, 2.12, 3.24])
    assert m.verify_graph_ms(12, 8) == pytest.approx((1.0 + 0.8 + 0.64 + 1.0 + 1.6 + 1.28) / 2)  # interpolated
    assert m.verify_graph_ms(8, 5) is None  # a level the tables do not hold
    with pytest.raises(ValueError, match="graph_shapes given without fn_verify_graph"):
        profile(lambda n: None, None, [1], [1], graph_shapes=[(1, 2)])


def test_verify_graph_tables_round_trip_and_old_files_still_load():
    m = CostModel(_model().verify, _model().draft, verify_graph={2: CostTable([1, 8], [0.5, 0.7]),
                                                                  8: CostTable([1, 8], [0.6, 1.2])})
    back = CostModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert sorted(back.verify_graph) == [2, 8] and back.verify_graph_ms(8, 8) == 1.2
    assert "verify graph of 8 tokens a request cost" in m.describe()
    old = _model().to_dict()
    assert "verify_graph" not in old and CostModel.from_dict(old).verify_graph == {}
    with pytest.raises(ValueError, match="verify graph levels"):
        CostModel.from_dict({**old, "verify_graph": {"0": {"sizes": [1], "ms": [0.1]}}})
