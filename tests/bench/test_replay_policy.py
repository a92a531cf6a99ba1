"""benchmarks/replay_policy.py: the adaptive policy replayed against a sweep's cost tables."""
import json

import numpy as np
import pytest

from adaspec.testing import load_benchmark

# the Qwen3-8B shape's tables on the H200 (run 17, up to 64 requests), its synthetic curve
TABLES = {"verify": {"sizes": [1, 64, 128, 192, 256, 384, 512], "ms": [5.65, 6.76, 7.19, 8.53, 9.45, 12.92, 16.67]},
          "draft": {"sizes": [1, 16, 64], "ms": [0.89, 1.18, 2.38]}}
CURVE = "0.8751,0.7492,0.7491,0.7454,0.7573,0.7834,0.7974"


@pytest.fixture(scope="module")
def replay():
    return load_benchmark("replay_policy")


def _sweep(tmp_path, **extra):
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"args": {"concurrency": "1,64", "synthetic_acceptance": CURVE},
                             "cost_tables": {"adaptive:7": TABLES}, **extra}))
    return p


def test_replay_explains_the_coarse_levels(replay, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert replay.main([str(_sweep(tmp_path)), "--json", str(out)]) == 0
    rows = {r["concurrency"]: r for r in json.loads(out.read_text())["rows"]}
    coarse, every = rows[64]["adaptive:7 levels 1,3,5,8"], rows[64]["adaptive:7 levels 1,2,3,4,5,6,7,8"]
    assert coarse["slots"] == 4 and every["slots"] == 3  # 3 drafts ran as 5 tokens with the coarse levels
    assert every["rate"] == pytest.approx(rows[64]["fixed:3"]["rate"]) and coarse["rate"] < every["rate"]
    assert rows[1]["fixed:7"]["rate"] > rows[1]["fixed:3"]["rate"] > rows[1]["plain"]["rate"]
    # a plain step is one token per request over verify_ms(requests), no drafter
    assert rows[64]["plain"]["rate"] == pytest.approx(64 / 6.76)
    assert "<- best" in capsys.readouterr().out


def test_replay_sets_the_measured_decode_rates_beside(replay, tmp_path, capsys):
    rows = [{"arm": "none", "concurrency": 64, "step_kinds": {"decode": {"tokens_per_ms": r}}} for r in (9.0, 10.0)]
    rows.append({"arm": "fixed:3", "concurrency": 64})  # an older sweep's row: no step_kinds
    out = tmp_path / "rows.json"
    assert replay.main([str(_sweep(tmp_path, rows=rows)), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["measured_decode_tokens_per_ms"] == {"none C=64": 9.5}
    assert "C=64    none             9.50" in capsys.readouterr().out


def test_replay_refuses_a_sweep_without_tables_or_curve(replay, tmp_path):
    p = tmp_path / "bare.json"
    p.write_text(json.dumps({"args": {"concurrency": "1"}}))
    with pytest.raises(SystemExit, match="no cost_tables"):
        replay.main([str(p)])
    p.write_text(json.dumps({"args": {"concurrency": "1"}, "cost_tables": {"adaptive:7": TABLES}}))
    with pytest.raises(SystemExit, match="no synthetic acceptance"):
        replay.main([str(p)])
    with pytest.raises(SystemExit, match="no cost tables for arm"):
        replay.main([str(_sweep(tmp_path)), "--arm", "adaptive:3"])


def test_replay_reads_the_tables_an_adaptive_server_logged(replay, tmp_path):
    from adaspec.spec_decode.profiler import TABLES_JSON_PREFIX

    pair = tmp_path / "pair.json"
    pair.write_text(json.dumps({"heldout": {"T=0": {"cond_acceptance": [float(x) for x in CURVE.split(",")]}}}))
    log = tmp_path / "server.log"
    log.write_text("2026-12-03 13:17:16,226 INFO adaspec.profile: cost tables: verify ms by tokens {...}\n"
                   f"2026-12-03 13:17:16,227 INFO adaspec.profile: {TABLES_JSON_PREFIX}{json.dumps(TABLES)}\n")
    from_log, from_sweep = tmp_path / "a.json", tmp_path / "b.json"
    assert replay.main(["--server-log", str(log), "--concurrency", "1,64", "--pair", str(pair),
                        "--json", str(from_log)]) == 0
    assert replay.main([str(_sweep(tmp_path)), "--pair", str(pair), "--json", str(from_sweep)]) == 0
    rows = [json.loads(p.read_text())["rows"] for p in (from_log, from_sweep)]
    assert rows[0] == rows[1]
    log.write_text("a log without the tables\n")
    with pytest.raises(SystemExit, match="no line with"):
        replay.main(["--server-log", str(log), "--concurrency", "1", "--pair", str(pair)])
    with pytest.raises(SystemExit):  # --server-log needs the concurrency the sweep would give
        replay.main(["--server-log", str(log), "--pair", str(pair)])


def _blocks(tmp_path, conf, accepted):
    p = tmp_path / "heldout_blocks.npz"
    np.savez_compressed(p, T0_conf=np.asarray(conf, dtype=np.float16), T0_accepted=np.asarray(accepted, dtype=np.uint8))
    return p


def test_replay_over_blocks_that_tell_requests_apart(replay, tmp_path):
    """Half the blocks accept all 7 drafts and say so (confidence .97), half accept none and say so
    (.05): the objective verifies the first kind's drafts only, which no fixed k can; blocks that all
    look alike leave it at the best fixed k's rate."""
    n = 2000
    sure = np.arange(n) % 2 == 0
    conf = np.where(sure[:, None], 0.97, 0.05) * np.ones((n, 7))
    p = _blocks(tmp_path, conf, np.where(sure, 7, 0))
    out = tmp_path / "rows.json"
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--concurrency", "64", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["fixed:7"]["tokens"] == pytest.approx(64 * 4.5, rel=0.05)  # half 8 tokens, half 1
    assert row["adaptive:7"]["slots"] == pytest.approx(3.5, rel=0.1)  # 7 drafts of the sure half only
    assert row["adaptive_over_best_fixed"] > 1.2
    alike = _blocks(tmp_path, np.tile(np.linspace(0.9, 0.8, 7), (n, 1)), np.arange(n) % 8)
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(alike), "--concurrency", "64", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["adaptive_over_best_fixed"] == pytest.approx(1.0, abs=0.03)


def test_the_oracle_row_knows_each_blocks_outcome(replay, tmp_path, capsys):
    """Blocks that all look alike (the same confidences) but accept 0 to 7 drafts: the policy can
    only do as well as the best fixed k, while the oracle verifies accepted drafts only (every
    verified slot is a token) and beats both; it is not an arm, so it is never marked best."""
    n = 2000
    p = _blocks(tmp_path, np.tile(np.linspace(0.9, 0.8, 7), (n, 1)), np.arange(n) % 8)
    out = tmp_path / "rows.json"
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--concurrency", "64", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    oracle = row["oracle:7 (knows acceptance)"]
    assert oracle["tokens"] == pytest.approx(64 * (1 + oracle["slots"]))  # no rejected draft verified
    assert oracle["slots"] <= 3.5 + 1e-9  # at most every accepted draft (mean 3.5 per block)
    assert row["adaptive_over_best_fixed"] == pytest.approx(1.0, abs=0.03)
    assert row["oracle_over_best_fixed"] > 1.1 and oracle["rate"] > row["adaptive:7"]["rate"]
    printed = capsys.readouterr().out
    assert "oracle / best fixed" in printed and not any("oracle" in ln and "<- best" in ln for ln in printed.splitlines())


def test_the_replay_says_what_the_confidences_expected_of_the_slots_it_verified(replay, tmp_path):
    """Half the blocks are sure (.97, accept all 7), half doubtful (.3, accept none): the objective
    verifies the sure half's drafts only, so what it expected is the sure half's survivals alone,
    not the doubtful half's unverified ones; the sure blocks' .97 underrates their all-accepted
    drafts, so the target accepted more than the expectation."""
    n = 2000
    sure = np.arange(n) % 2 == 0
    conf = np.where(sure[:, None], 0.97, 0.3) * np.ones((n, 7))
    out = tmp_path / "rows.json"
    p = _blocks(tmp_path, conf, np.where(sure, 7, 0))
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--concurrency", "64", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]["adaptive:7"]
    assert row["slots"] == pytest.approx(3.5, rel=0.05)
    sure_tokens = 32 * float(np.sum(0.97 ** np.arange(1, 8)))  # survivals .97 ** j, j = 1..7
    assert row["predicted_tokens"] == pytest.approx(64 + sure_tokens, rel=0.02)
    assert row["predicted_rate"] == pytest.approx(row["predicted_tokens"] / row["ms"])
    assert row["tokens"] == pytest.approx(64 + 32 * 7, rel=0.05) and row["tokens"] > row["predicted_tokens"]


def test_replay_over_blocks_refuses_a_missing_temperature(replay, tmp_path):
    p = _blocks(tmp_path, np.ones((4, 7)) * 0.5, [1, 2, 3, 4])
    with pytest.raises(SystemExit, match="no blocks at temperature 1"):
        replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--temperature", "1"])


def test_an_adaptive_narrow_arms_tables_price_each_step_by_the_draft_it_needs(replay, tmp_path):
    """An adaptive-narrow arm's tables carry narrow drafts: fixed:3 is priced with the 4-slot draft
    (the narrowest that holds 3), fixed:7 with the full one, and the adaptive step with the draft
    width its policy chose with the budget; the full arm's tables price every drafting step with
    the full draft."""
    narrow = {**TABLES, "draft_narrow": {"2": {"sizes": [1, 64], "ms": [0.3, 0.6]},
                                         "4": {"sizes": [1, 64], "ms": [0.5, 1.2]}}}
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"args": {"concurrency": "64", "synthetic_acceptance": CURVE},
                             "cost_tables": {"adaptive:7": TABLES, "adaptive-narrow:7": narrow}}))
    out = tmp_path / "rows.json"
    rows = {}
    for arm in ("adaptive:7", "adaptive-narrow:7"):
        assert replay.main([str(p), "--arm", arm, "--levels", "1,2,3,4,5,6,7,8", "--json", str(out)]) == 0
        rows[arm] = json.loads(out.read_text())["rows"][0]
    full, thin = rows["adaptive:7"], rows["adaptive-narrow:7"]
    verify = {256: 9.45, 512: 16.67}
    assert full["fixed:3"]["ms"] == pytest.approx(verify[256] + 2.38) and thin["fixed:3"]["ms"] == pytest.approx(verify[256] + 1.2)
    assert thin["fixed:7"]["ms"] == pytest.approx(full["fixed:7"]["ms"]) == pytest.approx(verify[512] + 2.38)
    a_full, a_thin = full["adaptive:7 levels 1,2,3,4,5,6,7,8"], thin["adaptive:7 levels 1,2,3,4,5,6,7,8"]
    assert a_thin["rate"] > a_full["rate"] and a_thin["slots"] <= 4


def test_a_host_overhead_is_paid_by_every_arm_and_priced_by_a_second_policy(replay, tmp_path):
    """--step-overhead-ms adds the host's per-step time to every arm's realized step (plain steps too,
    which makes drafting pay more against them); the `priced overhead` policy sees it and so can only
    verify as many drafts or more (step_overhead.py), and at a large overhead verifies more."""
    rng = np.random.default_rng(0)
    n = 4000
    conf = np.sort(rng.uniform(0.2, 0.95, size=(n, 7)), axis=1)[:, ::-1]
    accepted = (rng.uniform(size=(n, 7)) < conf).cumprod(axis=1).sum(axis=1)
    p = _blocks(tmp_path, conf, accepted)
    base, witho = tmp_path / "base.json", tmp_path / "over.json"
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--concurrency", "1,64", "--fixed", "1,3",
                        "--json", str(base)]) == 0
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--concurrency", "1,64", "--fixed", "1,3",
                        "--step-overhead-ms", "1:0.5,64:30", "--json", str(witho)]) == 0
    b = {r["concurrency"]: r for r in json.loads(base.read_text())["rows"]}
    o = {r["concurrency"]: r for r in json.loads(witho.read_text())["rows"]}
    assert "adaptive:7 priced overhead" not in b[64] and "priced_overhead_over_best_fixed" not in b[64]
    for c, extra in ((1, 0.5), (64, 30.0)):
        for name in ("plain", "fixed:1", "fixed:3"):
            assert o[c][name]["ms"] == pytest.approx(b[c][name]["ms"] + extra)
            assert o[c][name]["tokens"] == pytest.approx(b[c][name]["tokens"])
        # the tables-only policy decides as before and pays the overhead on every step
        assert o[c]["adaptive:7"]["slots"] == pytest.approx(b[c]["adaptive:7"]["slots"])
        assert o[c]["adaptive:7"]["ms"] == pytest.approx(b[c]["adaptive:7"]["ms"] + extra)
        assert o[c]["adaptive:7 priced overhead"]["slots"] >= o[c]["adaptive:7"]["slots"] - 1e-9
    assert o[64]["adaptive:7 priced overhead"]["slots"] > o[64]["adaptive:7"]["slots"]
    assert o[64]["adaptive:7 priced overhead"]["rate"] >= o[64]["adaptive:7"]["rate"]
    assert o[64]["plain"]["rate"] / o[64]["fixed:3"]["rate"] < b[64]["plain"]["rate"] / b[64]["fixed:3"]["rate"]


@pytest.mark.parametrize("text, message", [("128:3.0", "no overhead for concurrency"), ("-1", ">= 0 ms"),
                                           ("64:x", "give a number of ms"), ("1:2:3", "give a number of ms")])
def test_a_bad_step_overhead_is_refused_by_name(replay, tmp_path, text, message):
    p = _blocks(tmp_path, np.ones((4, 7)) * 0.5, [1, 2, 3, 4])
    with pytest.raises(SystemExit, match=message):
        replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--concurrency", "1,64", "--step-overhead-ms", text])


def test_a_step_overhead_needs_blocks(replay, tmp_path):
    with pytest.raises(SystemExit):
        replay.main([str(_sweep(tmp_path)), "--step-overhead-ms", "2"])


def test_slot_auc_matches_counting_every_pair(replay):
    """The AUC per slot against its definition: over every (accepted, rejected) pair of blocks that
    reach the slot, the share where the accepted one has the higher confidence (ties count half)."""
    rng = np.random.default_rng(5)
    n, k = 300, 4
    conf = np.round(rng.random((n, k)), 1)  # coarse values: many ties
    accepted = rng.integers(0, k + 1, n)
    got = replay.slot_auc(conf, accepted)
    for j in range(k):
        reached = accepted >= j
        pos = conf[reached & (accepted > j), j]
        neg = conf[reached & (accepted == j), j]
        want = float(np.mean((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])))
        assert got[j] == pytest.approx(want)
    assert replay.slot_auc(np.ones((5, 2)), np.full(5, 2)) == [None, None]  # every block accepts both


def test_the_ideal_row_decides_on_the_acceptance_probabilities(replay, tmp_path, capsys):
    """Half the blocks accept each draft with probability .95, half with .2, the outcomes drawn from
    those; the confidences are alike for all (.6): the policy is left at the best fixed k, the ideal
    row (which knows the probabilities, not the draws) verifies the likely half's drafts and beats it,
    and the oracle (which knows the draws) beats the ideal row; neither is ever marked best."""
    n, k = 4000, 7
    rng = np.random.default_rng(0)
    alpha = np.where((np.arange(n) % 2 == 0)[:, None], 0.95, 0.2) * np.ones((n, k))
    accepted = np.cumprod(rng.random((n, k)) < alpha, axis=1).sum(1)
    p = tmp_path / "heldout_blocks.npz"
    np.savez_compressed(p, T1_conf=np.full((n, k), 0.6, dtype=np.float16), T1_accepted=accepted.astype(np.uint8),
                        T1_alpha=alpha.astype(np.float16))
    out = tmp_path / "rows.json"
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--temperature", "1", "--concurrency", "64",
                        "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    row = res["rows"][0]
    ideal, oracle = row["ideal:7 (knows acceptance probabilities)"], row["oracle:7 (knows acceptance)"]
    assert row["adaptive_over_best_fixed"] == pytest.approx(1.0, abs=0.03)
    assert row["ideal_over_best_fixed"] > 1.1 and oracle["rate"] > ideal["rate"] > row["adaptive:7"]["rate"]
    # its expectation is the probabilities' own, so it comes true within the draws' noise
    assert ideal["predicted_tokens"] == pytest.approx(ideal["tokens"], rel=0.05)
    # slot 1 (every block reaches it): accepted blocks are the likely kind with odds .95 / 1.15, rejected
    # ones with .05 / .85; the AUC counts likely-over-unlikely pairs and half the ties
    good_pos, good_neg = 0.95 / 1.15, 0.05 / 0.85
    expected = good_pos * (1 - good_neg) + 0.5 * (good_pos * good_neg + (1 - good_pos) * (1 - good_neg))
    assert res["slot_auc_ideal"][0] == pytest.approx(expected, abs=0.02)
    assert all(a == pytest.approx(0.5) for a in res["slot_auc"])  # alike confidences tell nothing
    printed = capsys.readouterr().out
    assert "ideal / best fixed" in printed and "the most any confidence can tell" in printed
    assert not any(("ideal" in ln or "oracle" in ln) and "<- best" in ln for ln in printed.splitlines())
    # blocks without the probabilities (builds before them): no ideal row
    np.savez_compressed(p, T1_conf=np.full((n, k), 0.6, dtype=np.float16), T1_accepted=accepted.astype(np.uint8))
    assert replay.main([str(_sweep(tmp_path)), "--blocks", str(p), "--temperature", "1", "--concurrency", "64",
                        "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "ideal_over_best_fixed" not in res["rows"][0] and res["slot_auc_ideal"] is None


def test_the_replayed_adaptive_step_drafts_the_width_its_policy_chose_with_the_budget(replay, tmp_path):
    """Narrow-draft tables and blocks of which an eighth are sure of every slot: the policy (as the
    engine runs it, policy.width_capped_objective) drafts 2 slots of every request and caps each at
    2, so the replay allocates with that cap and prices the 2-slot draft. Allocated without the cap,
    the sure blocks' deep slots would take the budget and need the full draft."""
    from adaspec.spec_decode.cost_model import CostModel
    from adaspec.spec_decode.policy import allocate, survival

    narrow = {**TABLES, "draft_narrow": {"2": {"sizes": [1, 64], "ms": [0.3, 0.6]}}}
    n = 2048
    sure = np.arange(n) % 8 == 0
    conf = np.where(sure[:, None], 0.99, np.array([0.9, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2])[None, :])
    accepted = np.where(sure, 7, np.arange(n) % 3)
    surv = survival(conf[:64])
    cost = replay.padded_cost(CostModel.from_dict(narrow), [64], list(range(1, 9)))
    b, lengths, width = replay.choose(surv, 64, cost)
    assert width == 2 and b > 64 and lengths.max() == 2 and lengths.sum() == b
    assert allocate(surv, b).max() == 7  # what the uncapped allocation would have drafted for
    p = tmp_path / "sweep.json"
    p.write_text(json.dumps({"args": {"concurrency": "64", "synthetic_acceptance": CURVE},
                             "cost_tables": {"adaptive-narrow:7": narrow}}))
    out = tmp_path / "rows.json"
    assert replay.main([str(p), "--arm", "adaptive-narrow:7", "--blocks", str(_blocks(tmp_path, conf, accepted)),
                        "--concurrency", "64", "--max-num-seqs", "64", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]["adaptive:7"]
    # the draws are seeded: priced by the widths chosen, 10.3 ms a step; priced by the uncapped
    # allocation's deepest slot (the replay before width_capped_objective), the same draws 11.3 ms
    assert row["ms"] < 10.8 and row["slots"] < 3
