"""The adaptive policy's cost tables checked against the steps they priced: the counters by query
tokens per request (engine/stats.py record_step_cost), the policy's report of each drafting step
it planned (fake timings, no clock), /metrics -> the bench point (specstats), the report's table,
and an adaptive engine on the CPU end to end."""
import numpy as np
import pytest
from prometheus_client import generate_latest

from adaspec import LLM, SamplingParams
from adaspec.bench.cost_check_report import cost_check_section, pooled
from adaspec.bench.specstats import parse_spec_counters, spec_delta
from adaspec.engine.stats import EngineStats
from adaspec.spec_decode.policy import AdaptivePolicy


class Tables:
    """draft 1 ms + 0.01 ms per request; verify 2 ms + 0.02 ms per token, vectorized."""

    def draft_ms(self, r):
        return 1.0 + 0.01 * r

    def verify_ms(self, n):
        return 2.0 + 0.02 * np.asarray(n, dtype=np.float64)


def test_steps_are_counted_by_query_tokens_per_request():
    s = EngineStats()
    s.record_step_cost(4, 4, 0, 1.0, 1.5)  # no draft verified: q = 1
    s.record_step_cost(4, 4, 5, 2.0, 3.0)  # 9 tokens over 4 requests: q = 3 (rounded up)
    s.record_step_cost(4, 4, 8, 2.5, 4.0)  # q = 3
    s.record_step_cost(4, 4 + 64, 8, 9.0, 9.0)  # a prefill chunk rode along: the tables do not price it
    s.record_step_cost(0, 0, 0, 1.0, 1.0)  # nothing ran
    assert s.cost_check_steps == [1, 0, 2]
    assert s.cost_check_priced_ms == [1.0, 0.0, 4.5] and s.cost_check_wall_ms == [1.5, 0.0, 7.0]
    assert s.cost_check_requests == [4, 0, 8]


def test_the_policy_reports_each_drafting_step_it_planned_with_the_tables_price():
    seen = []
    tables = Tables()
    policy = AdaptivePolicy(tables, k=4, on_step_cost=lambda *a: seen.append(a))
    ids, limits = ["a", "b"], np.array([4, 4])
    policy.observe_step(50.0)  # a step the policy did not plan: nothing to report
    assert seen == []
    assert policy.should_draft(ids, 2, 2, limits)  # unknown requests count as confidence 1: drafting pays
    b = policy.step_budget(ids, 2, 2, limits)
    policy.observe_step(9.0)
    assert seen == [(2, 2, b, pytest.approx(float(tables.draft_ms(2)) + float(tables.verify_ms(2 + b))), 9.0)]
    # a step without drafts is not a drafting step: not reported
    slow = AdaptivePolicy(tables, k=4, probe_every=100, on_step_cost=lambda *a: seen.append(a))
    slow.observe(["a"], np.array([[0.0] * 4]))
    assert not slow.should_draft(["a"], 1, 1, np.array([4]))
    slow.observe_step(3.0)
    assert len(seen) == 1


class Engine:  # what ServerMetrics.update_engine reads
    def __init__(self):
        self.stats = EngineStats()

    def num_running(self):
        return 0

    def num_waiting(self):
        return 0

    def kv_blocks_total(self):
        return 1

    def kv_blocks_free(self):
        return 1


def test_metrics_to_the_bench_point_and_the_report():
    from adaspec.serve.metrics import ServerMetrics

    eng, m = Engine(), ServerMetrics("m")
    eng.stats.record_step_cost(2, 2, 2, 1.0, 2.0)  # q = 2
    m.update_engine(eng)
    before = parse_spec_counters(generate_latest(m.registry).decode())
    for wall in (3.0, 5.0):
        eng.stats.record_step_cost(2, 2, 2, 1.5, wall)  # q = 2
    eng.stats.record_step_cost(3, 3, 9, 2.0, 8.0)  # q = 4, three requests
    m.update_engine(eng)
    after = parse_spec_counters(generate_latest(m.registry).decode())
    assert after["cost_check_steps"] == {2: 3.0, 4: 1.0}
    assert after["cost_check_requests"] == {2: 6.0, 4: 3.0}
    d = spec_delta(before, after)
    # [steps, priced, wall, requests] per step
    assert d["spec_cost_check"] == {"2": [2.0, 1.5, 4.0, 2.0], "4": [1.0, 2.0, 8.0, 3.0]}
    assert d["spec_cost_ratio"] == pytest.approx((3.0 + 5.0 + 8.0) / (1.5 + 1.5 + 2.0))
    assert spec_delta({}, {"drafts": 3.0})["spec_cost_check"] is None  # vLLM or a fixed k: nothing invented
    # the report pools the repeats, weighting each by its steps
    points = [{"arm": "adaptive:7", "concurrency": 16, "spec_cost_check": d["spec_cost_check"]},
              {"arm": "adaptive:7", "concurrency": 16, "spec_cost_check": {"2": [2.0, 2.5, 6.0, 4.0]}},
              {"arm": "fixed:3", "concurrency": 16, "spec_cost_check": None}]
    assert pooled(points) == {("adaptive:7", 16): {2: [4.0, 8.0, 20.0, 12.0], 4: [1.0, 2.0, 8.0, 3.0]}}
    lines = cost_check_section(points, ["fixed:3", "adaptive:7"])
    assert "| adaptive:7 | 16 | 4 (R 3): 2.00 -> 5.00 | 1 (R 3): 2.00 -> 8.00 |" in lines
    assert cost_check_section(points[2:], ["fixed:3"]) == []
    # a point from a server without the requests counter (three values a cell): no batch shown
    older = [points[0], {"arm": "adaptive:7", "concurrency": 16, "spec_cost_check": {"2": [2.0, 2.5, 6.0]}}]
    assert pooled(older)[("adaptive:7", 16)][2] == [4.0, 8.0, 20.0, None]
    assert "| adaptive:7 | 16 | 4: 2.00 -> 5.00 | 1 (R 3): 2.00 -> 8.00 |" in cost_check_section(older, ["adaptive:7"])


def test_the_engine_process_ships_every_counter_the_metrics_read():
    # on CUDA the server's engine runs in a process of its own and sends the HTTP side a snapshot of
    # its stats (serve/engine_process.py): H200 run 29's adaptive servers showed no cost check
    # because the snapshot left those counters out. /metrics must read the same through it.
    from adaspec.serve.engine_process import EngineSnapshot
    from adaspec.serve.metrics import ServerMetrics

    eng = Engine()
    st = eng.stats
    st.ensure_positions(3)
    st.num_steps, st.num_generated_tokens, st.num_drafts, st.num_accepted_tokens = 7, 40, 9, 12
    st.accepted_per_pos[:] = [5, 3, 1]
    st.predicted_accept_per_pos[:] = [4.5, 2.5, 1.5]
    st.budget_hist[6] = 4
    st.record_step_cost(2, 2, 6, 2.0, 3.0)
    direct, shipped = ServerMetrics("m"), ServerMetrics("m")
    direct.update_engine(eng)
    shipped.update_engine(EngineSnapshot.of(eng))
    text = generate_latest(shipped.registry).decode()
    assert parse_spec_counters(text) == parse_spec_counters(generate_latest(direct.registry).decode())
    assert 'adaspec:spec_decode_cost_check_steps_total{model_name="m",query_len="4"} 1.0' in text


def test_an_adaptive_engine_counts_its_decode_steps(micro_pair, tmp_path, monkeypatch):
    # on the CPU the micro drafter costs as much as its target, so the policy would stop drafting
    # after the first step: make every step draft (its budget still the policy's)
    pays = AdaptivePolicy._draft_pays
    monkeypatch.setattr(AdaptivePolicy, "_draft_pays", lambda self, *a: (True, *pays(self, *a)[1:]))
    spec = {"method": "dspark", "model": micro_pair[1], "num_speculative_tokens": 3,
            "enable_adaptive_verification": True, "cost_model_cache_dir": str(tmp_path)}
    llm = LLM(micro_pair[0], speculative_config=spec, device="cpu", max_num_seqs=8)
    # 40 tokens: at most 4 per decode step (3 drafts and the bonus), so at least 9 decode steps
    # whatever the (machine-timed) tables make the budgets
    llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    s = llm.llm_engine.stats
    n = int(sum(s.cost_check_steps))
    assert n >= 9 and len(s.cost_check_steps) <= 3 + 1  # q is at most k + 1
    assert all(p > 0 for p, c in zip(s.cost_check_priced_ms, s.cost_check_steps) if c)
    assert all(w > 0 for w, c in zip(s.cost_check_wall_ms, s.cost_check_steps) if c)
    # fixed k: no policy prices anything
    fixed = LLM(micro_pair[0], speculative_config={**spec, "enable_adaptive_verification": False}, device="cpu")
    fixed.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert fixed.llm_engine.stats.cost_check_steps == []


def test_the_tables_are_described_in_one_line():
    from adaspec.spec_decode.cost_model import CostModel, CostTable
    from adaspec.spec_decode.profiler import describe_tables

    m = CostModel(CostTable([8, 16], [1.0, 1.25]), CostTable([1, 2], [0.5, 0.75]), {2: CostTable([1, 2], [0.25, 0.5])})
    assert describe_tables(m) == ("verify ms by tokens {8: 1.000, 16: 1.250}; draft ms by requests {1: 0.500, "
                                  "2: 0.750}; draft of 2 slots ms by requests {1: 0.250, 2: 0.500}")


def test_each_step_shape_is_priced_once(monkeypatch):
    """The report sits on the per-step path: a shape already priced is looked up, not priced again."""
    seen, calls = [], []
    policy = AdaptivePolicy(Tables(), k=4, on_step_cost=lambda *a: seen.append(a))
    priced = policy._priced_ms
    monkeypatch.setattr(policy, "_priced_ms", lambda *a: calls.append(a) or priced(*a))
    ids, limits = ["a", "b"], np.array([4, 4])
    for wall in (5.0, 6.0, 7.0):
        assert policy.should_draft(ids, 2, 2, limits)
        policy.step_budget(ids, 2, 2, limits)
        policy.observe_step(wall)
    assert len(seen) == 3 and len({a[:4] for a in seen}) == 1 and [a[4] for a in seen] == [5.0, 6.0, 7.0]
    assert len(calls) == 1
