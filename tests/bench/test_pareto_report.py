"""Pareto edge, dominance beyond spread and the report, on synthetic results with known answers."""
import json

from hypothesis import given, strategies as st

from adaspec.bench.aggregate import aggregate, mean_std
from adaspec.bench.pareto import Point, dominance, dominated_beyond_spread, edge_gap, pareto_edge, staircase
from adaspec.bench.report import md_to_html, write_report


def P(k, x, y, sx=0.0, sy=0.0):
    return Point(k, x, y, sx, sy)


def test_edge_known_answer():
    pts = [P("a", 10, 100), P("b", 20, 80), P("c", 15, 70), P("d", 30, 20), P("e", 5, 90), P("f", 20, 80)]
    edge = pareto_edge(pts)
    # c is beaten by b; e by a; f duplicates b (one corner kept)
    assert [(p.x, p.y) for p in edge] == [(10, 100), (20, 80), (30, 20)]
    assert staircase(edge) == ([10, 10, 20, 20, 30], [100, 80, 80, 20, 20])


def test_edge_gap_known_answer():
    edge = pareto_edge([P("a", 10, 100), P("b", 20, 80), P("d", 30, 20)])
    # c = (15, 70): best throughput at >= 15 tok/s/user is b's 80 -> 12.5 % below;
    # best per-user speed at >= 70 tok/s is b's 20 -> 25 % below
    gy, gx = edge_gap(P("c", 15, 70), edge)
    assert abs(gy - 12.5) < 1e-9 and abs(gx - 25.0) < 1e-9
    assert edge_gap(P("b", 20, 80), edge) == (0.0, 0.0)


def test_dominance_needs_both_axes_beyond_spread():
    a = P("a", 10, 100, 1, 5)
    b = P("b", 13, 120, 1, 5)  # better on both: 10+1 < 13-1 and 100+5 < 120-5
    c = P("c", 12, 120, 1, 5)  # x gap 2 == spreads 1+1: not beyond spread
    d = P("d", 30, 90, 1, 1)  # faster but less throughput: a trade-off, never dominance
    assert dominated_beyond_spread(a, b)
    assert not dominated_beyond_spread(a, c)
    assert not dominated_beyond_spread(a, d) and not dominated_beyond_spread(d, a)
    assert dominance([a, b, c, d]) == {"a": ["b"], "b": [], "c": [], "d": []}


@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)), min_size=1, max_size=30))
def test_edge_properties(xy):
    pts = [P(i, x, y) for i, (x, y) in enumerate(xy)]
    edge = pareto_edge(pts)
    assert edge
    # every point is on the edge or matched on both axes by an edge point, and has gap 0 iff so
    for p in pts:
        assert any(q.x >= p.x and q.y >= p.y for q in edge)
        gy, gx = edge_gap(p, edge)
        assert 0 <= gy <= 100 and 0 <= gx <= 100
    # the edge trades one axis for the other: x ascending means y descending
    assert all(a.x < b.x and a.y > b.y for a, b in zip(edge, edge[1:]))


def test_mean_std_sample():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert mean_std([5.0]) == (5.0, 0.0)
    assert mean_std([None]) == (None, None)


def synthetic_point(arm, c, r, tput, speed, **kw):
    d = {"arm": arm, "concurrency": c, "repeat": r, "complete": True, "completed": 10, "failed": 0,
         "output_throughput": tput, "median_per_user_tok_s": speed, "median_ttft_ms": 10.0 * c,
         "p99_ttft_ms": 20.0 * c, "p99_itl_ms": 5.0}
    d.update(kw)
    return d


def write_points(tmp_path, points, manifest=None):
    (tmp_path / "points").mkdir(parents=True, exist_ok=True)
    for p in points:
        (tmp_path / "points" / f"{p['arm'].replace(':', '-')}_c{p['concurrency']}_r{p['repeat']}.json").write_text(json.dumps(p))
    if manifest:
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))


SYN = [
    # at C=1 spec arms are faster per user with more throughput; fixed:7 dominates none
    *(synthetic_point("none", 1, r, 50 + r, 50 + r) for r in range(3)),
    *(synthetic_point("fixed:7", 1, r, 120 + r, 118 + r, spec_acceptance_rate=0.6, spec_mean_accepted_length=3.0) for r in range(3)),
    # at C=16 fixed:7 loses throughput but stays faster per user: a trade-off, nobody dominated
    *(synthetic_point("none", 16, r, 600 + 10 * r, 38 + r) for r in range(3)),
    *(synthetic_point("fixed:7", 16, r, 500 + 10 * r, 60 + r) for r in range(3)),
]


def test_aggregate_and_verdict(tmp_path):
    cells = aggregate(SYN)
    assert cells[("none", 16)].mean["output_throughput"] == 610
    assert cells[("none", 16)].std["output_throughput"] == 10
    manifest = {"model": "m", "drafter": "d", "arms": [{"name": "none", "speculative_config": None},
                                                       {"name": "fixed:7", "speculative_config": {"num_speculative_tokens": 7}}],
                "hardware": {"cpu": "X", "cpu_cores": 2, "gpu": None}, "repeats": 3, "temperature": 1.0}
    write_points(tmp_path, SYN + [{"arm": "none", "concurrency": 64, "repeat": 0, "complete": False}], manifest)
    (tmp_path / "points" / "torn.json").write_text("{")  # an interrupted write is ignored
    res = write_report(tmp_path, html_too=True)
    md = (tmp_path / "report.md").read_text()
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<table>" in (tmp_path / "report.html").read_text()
    assert res["markdown"].strip() == md.strip()
    assert "| C | none | fixed:7 |" in md
    assert "| 16 | 610.0 ± 10.0 | 510.0 ± 10.0 |" in md
    assert "| 1 | 51.0 ± 1.00 | 121.0 ± 1.00 |" in md
    assert "| 16 | 39.0 ± 1.00 | 61.0 ± 1.00 |" in md  # per-user speed table
    lines = {l.split("**")[1]: l for l in md.splitlines() if l.startswith("- **C=")}
    assert "dominated beyond spread: `none` (by `fixed:7`)" in lines["C=1"]
    assert "dominated beyond spread: none." in lines["C=16"]
    # C=16: none (610, 39) and fixed:7 (510, 61) are both on the edge; none at C=1 is not
    assert "`none` on the edge; `fixed:7` on the edge" in lines["C=16"]
    # none at C=1 (51, 51): fixed:7 at C=16 gets 510 tok/s at >= 51 tok/s/user -> 90 % below;
    # the fastest point with >= 51 tok/s is fixed:7 at C=1 (119 tok/s/user) -> 57.1 % below
    assert "`none` 90.0% below in throughput, 57.1% below in per-user speed" in lines["C=1"]
    assert "- hardware: CPU only: X, 2 cores" in md
    assert "0.600 / 3.00" in md  # speculation table
    assert "C=64" not in md  # incomplete point not reported
    assert "burst" not in md  # no stream was flushed in one burst
    # streams flushed in one burst are named, per arm and concurrency, over the repeats
    pts = [dict(p, burst_delivered_requests=2) if (p["arm"], p["concurrency"]) == ("fixed:7", 16) else p for p in SYN]
    write_points(tmp_path, pts, manifest)
    md = write_report(tmp_path)["markdown"]
    assert "## Warnings" in md and "delivered in one burst after a wait" in md and "fixed:7 at C=16 6 of 30" in md
    assert "CPU-bound" not in md  # the points carry no client CPU
    # a CPU-bound client is named with its busiest repeat; one under the threshold is not
    pts = [dict(p, client_cpu_per_wall=0.95 if (p["arm"], p["concurrency"], p["repeat"]) == ("none", 1, 0) else 0.89)
           for p in SYN]
    write_points(tmp_path, pts, manifest)
    md = write_report(tmp_path)["markdown"]
    assert "## Warnings" in md and "the benchmark client was CPU-bound" in md and "none at C=1 0.95" in md
    assert "at C=16 0.89" not in md and "none at C=16" not in md
    assert "requests failed" not in md and "no usage chunk" not in md
    # failed requests and responses without usage are counted over every point
    pts = [dict(p, failed=2, usage_missing_requests=1) if (p["arm"], p["concurrency"]) == ("fixed:7", 16) else p
           for p in SYN]
    write_points(tmp_path, pts, manifest)
    md = write_report(tmp_path)["markdown"]
    assert "- 6 requests failed in total" in md and "- 3 responses had no usage chunk" in md


def test_md_to_html_escapes():
    h = md_to_html("# t\n\n- `a<b>`\n\n| x | y |\n|---|---|\n| 1 | 2 |\n")
    assert "<h1>t</h1>" in h and "<code>a&lt;b&gt;</code>" in h and "<td>1</td>" in h


def test_arm_colours_are_the_same_in_every_plot(tmp_path, monkeypatch):
    from adaspec import figures
    from adaspec.bench.plot import plot_frontier

    seen = []

    def record(fig, path, *a, **k):
        seen.append({c.get_label(): c.lines[0].get_color() for c in fig.axes[0].containers})

    monkeypatch.setattr(figures, "save_png", record)
    full = ["none", "fixed:3", "fixed:7", "adaptive:7"]
    pts = [synthetic_point(a, c, 0, 100.0 - c, 10.0 * (i + 1) + c) for i, a in enumerate(full) for c in (1, 4)]
    cells = aggregate(pts)
    plot_frontier(cells, full, tmp_path / "a.png")
    plot_frontier({k: v for k, v in cells.items() if k[0] != "none"}, full[1:], tmp_path / "b.png")
    plot_frontier({k: v for k, v in cells.items() if k[0] == "adaptive:7"}, ["adaptive:7"], tmp_path / "c.png")
    a, b, c = seen
    assert len(set(a.values())) == 4  # distinct arms, distinct colours
    assert b == {k: a[k] for k in b} and c == {"adaptive:7": a["adaptive:7"]}


def test_engine_steps_table_only_when_the_server_exported_them(tmp_path):
    steps = dict(engine_steps=100.0, engine_mean_step_ms=4.0, engine_output_tokens_per_step=12.5)
    pts = [synthetic_point("none", 8, r, 100, 20, **steps, engine_busy_fraction=0.5 + 0.1 * r) for r in range(2)]
    pts += [synthetic_point("fixed:7", 8, r, 150, 30, **steps, engine_busy_fraction=None) for r in range(2)]
    write_points(tmp_path / "a", pts)
    md = write_report(tmp_path / "a")["markdown"]
    assert "## Engine steps (from /metrics" in md
    assert "| 8 | 4.00 / 12.5 / – | 4.00 / 12.5 / 0.55 |" in md  # busy: mean over repeats; unknown stays unknown
    write_points(tmp_path / "b", SYN)  # a server without these counters (vLLM): no such table
    assert "## Engine steps" not in write_report(tmp_path / "b")["markdown"]
