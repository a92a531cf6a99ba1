"""Replay the adaptive policy against the cost tables a sweep profiled: what each arm's decode step
is predicted to make (tokens per ms) at each concurrency, and how many slots the adaptive budget
verifies, under the CUDA graphs' query-token levels as captured and under other levels.

An offline sweep's JSON (benchmarks/offline_sweep.py) carries every adaptive arm's profiled cost
tables (`cost_tables`); the acceptance curve comes from the sweep itself (synthetic acceptance) or
from a pair.json's held-out conditional acceptance. Every request is taken to decode with the
same survivals (the curve's running products), as the synthetic method draws them: the replay
asks what the policy's objective (spec_decode/policy.py: budget_objective, priced by
graphed_step.GraphPaddedCost as the engine prices it) chooses, and what each fixed k and a plain
step would make under the same tables. Prefill chunks, host time between steps and probes are not
modelled: the replay explains the decode steps' choice, the sweep measures the whole run. Every
drafting arm is priced with the chosen adaptive arm's draft tables: the full draft (k slots), or for
an adaptive-narrow arm's tables (--arm adaptive-narrow:K) the narrowest profiled draft that holds the
slots a step drafts per request: k for a fixed k, and for the adaptive step the width its policy
chooses with the budget, every request capped at it (policy.width_capped_objective), as the engine
runs it.

With --blocks (a build's drafter/heldout_blocks.npz: every block the held-out decoding walk reaches,
its calibrated confidences and accepted drafts) the requests differ as real ones do: each step draws
C blocks, the objective picks the budget from their confidences and allocates it, and the tokens
are the ones those blocks really accept; fixed k and plain steps run over the same draws. This is
what the confidences can buy over the best fixed k at each C under the tables. The budget is taken
from the drawn blocks' own confidences (the engine takes it from each request's previous step, and
allocates with the current ones as here), so the adaptive figure is an upper bound of the policy's.
Beside each adaptive row, the rate its confidences expected (the survivals of the slots it verified):
the gap to the realized rate is the calibration's error on the slots the policy chose. The row
`oracle:K (knows acceptance)` runs the same objective with survivals that know each block's
outcome (1 up to its accepted drafts, 0 after): what perfect confidences would buy under the same
tables, so the gap between it and adaptive:K is what the confidences' power to tell blocks apart
costs, and the gap between it and the best fixed k what the pair's acceptance leaves to win.
At T > 0 no confidence can know a sampled outcome: where the blocks file holds each slot's
acceptance probability (`T{t}_alpha`, builds since 2026-12-05), the row `ideal:K (knows acceptance
probabilities)` runs the objective with survivals that are those probabilities' products, the best
any confidence head could predict, and the AUC line gets their AUC beside the confidences'; the gap
between ideal and oracle is the sampling's share, which no drafter's confidence can close.

The tables price the GPU work only. A served step also pays the host (scheduling, bookkeeping, the
prefill chunks that ride along): H200 run 30's no-spec server took 5.3 / 7.0 ms per step at 128 /
256 requests where the tables priced 2.2 / 2.7 ms. --step-overhead-ms adds such a per-step cost
(one number, or per concurrency: 128:3.0,256:4.4) to every arm's realized steps, plain ones too, so
the rates compare as the server's would; the adaptive policy still decides on the tables alone, as
the engine does by default, and a second adaptive row, `adaptive:K priced overhead`, decides with
the overhead in its prices (the engine's adaptive_verification_step_overhead_ms, spec_decode/
step_overhead.py).

    python benchmarks/replay_policy.py SWEEP.json [--pair pair.json | --blocks heldout_blocks.npz]
        [--temperature 0] [--levels 1,3,5,8 --levels 1,2,3,4,5,6,7,8] [--max-num-seqs N] [--json OUT.json]
    python benchmarks/replay_policy.py --server-log SERVER.log --concurrency 16,64 --blocks heldout_blocks.npz ...
        (the tables an adaptive server logged: its "cost tables (json): " line)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaspec.bench.json_file import read_json  # noqa: E402
from adaspec.spec_decode.calibration import auc  # noqa: E402
from adaspec.engine.cuda_graphs import capture_sizes  # noqa: E402
from adaspec.spec_decode.cost_model import CostModel  # noqa: E402
from adaspec.spec_decode.graphed_step import GraphPaddedCost, query_levels  # noqa: E402
from adaspec.spec_decode.policy import (  # noqa: E402
    allocate, choose_budget_width, step_draft_ms, survival, width_capped_objective,
)
from adaspec.spec_decode.step_overhead import OverheadCost, StepOverhead  # noqa: E402


def padded_cost(cost: CostModel, batch_sizes: list[int], levels: list[int]) -> GraphPaddedCost:
    """The tables as a graphed step with these capture sizes and query levels pays them."""
    graphed = SimpleNamespace(verify_graphs={None: None}, batch_sizes=sorted(batch_sizes), levels=sorted(levels))
    return GraphPaddedCost(cost, graphed)


def step_ms(cost: GraphPaddedCost, requests: int, tokens: int, drafting: bool = True, need: int | None = None) -> float:
    """What a step of `tokens` query tokens over `requests` requests costs as the graphs pay it
    (the padded verify), plus the draft pass when it drafts: of `need` slots per request where the
    tables price narrower drafts (an adaptive-narrow arm's), else the full draft."""
    verify = float(np.ravel(cost.verify_ms_for(requests, tokens))[0])
    if not drafting:
        return verify
    return verify + (float(cost.draft_ms(requests)) if need is None else float(step_draft_ms(cost, requests, np.array([need]))[0]))


def fixed_rate(cost: GraphPaddedCost, survivals: np.ndarray, requests: int, slots: int) -> dict:
    """A drafting step that verifies `slots` drafts of every request."""
    tokens = requests * (1 + float(np.sum(survivals[:slots])))
    ms = step_ms(cost, requests, requests * (1 + slots), need=slots)
    return dict(slots=float(slots), tokens=tokens, ms=ms, rate=tokens / ms)


def plain_rate(cost: GraphPaddedCost, requests: int) -> dict:
    """A step without drafts: one token per request, no drafter."""
    ms = step_ms(cost, requests, requests, drafting=False)
    return dict(slots=0.0, tokens=float(requests), ms=ms, rate=requests / ms)


def choose(survivals: np.ndarray, requests: int, cost) -> tuple[int, np.ndarray, int]:
    """(budget, verify lengths, draft width) as the engine's policy picks them for a decode-only
    step of `requests` requests (policy.choose_budget_width), the budget allocated with every request
    capped at the width. Without narrow-draft tables the width is k and caps nothing."""
    b, w = choose_budget_width(survivals, requests, requests, requests, cost)
    return b, allocate(survivals, b, np.full(len(survivals), w)), w


def adaptive_rate(cost: GraphPaddedCost, survivals: np.ndarray, requests: int) -> dict:
    """The budget the policy's objective picks for `requests` requests with these survivals."""
    grid = np.tile(survivals, (requests, 1))
    objective, _, gain = width_capped_objective(grid, requests, requests, requests, cost)
    b = int(np.argmax(objective))
    ratio, tokens = float(objective[b]), float(gain[b])
    return dict(slots=b / requests, tokens=tokens, ms=tokens / ratio, rate=ratio)


def replay(cost_tables: dict, curve: list[float], concurrency: list[int], level_sets: list[list[int]],
           fixed_ks: list[int], max_num_seqs: int) -> list[dict]:
    """One row per concurrency: plain, each fixed k (its own levels), adaptive under each level set."""
    cost = CostModel.from_dict(cost_tables)
    k = len(curve)
    survivals = np.cumprod(np.clip(np.asarray(curve, dtype=np.float64), 0.0, 1.0))
    sizes = capture_sizes(max_num_seqs)
    rows = []
    for c in concurrency:
        row = {"concurrency": c, "plain": plain_rate(padded_cost(cost, sizes, query_levels(k)), c)}
        for fk in fixed_ks:
            row[f"fixed:{fk}"] = fixed_rate(padded_cost(cost, sizes, query_levels(fk)), survivals, c, fk)
        for levels in level_sets:
            row[f"adaptive:{k} levels {','.join(map(str, levels))}"] = adaptive_rate(
                padded_cost(cost, sizes, levels), survivals, c)
        rows.append(row)
    return rows


IDEAL = "ideal:{k} (knows acceptance probabilities)"


def replay_blocks(cost_tables: dict, conf: np.ndarray, accepted: np.ndarray, concurrency: list[int],
                  fixed_ks: list[int], max_num_seqs: int, steps: int = 200, seed: int = 0,
                  overhead_ms: dict[int, float] | None = None, alpha: np.ndarray | None = None) -> list[dict]:
    """Steps of C requests drawn from real blocks (conf [N, k] calibrated, accepted [N]): the tokens
    per ms that plain steps, each fixed k and the adaptive objective (every query level) realize.
    overhead_ms[C] (default 0): host time every step pays beyond the tables; with it a second
    adaptive row whose policy prices it (`adaptive:K priced overhead`). alpha [N, k] (optional):
    each slot's acceptance probability given the block's prefix; with it the `ideal:K` row, the
    objective deciding on the survivals those give (the same draws, the same outcomes)."""
    cost = CostModel.from_dict(cost_tables)
    k = conf.shape[1]
    conf = np.asarray(conf, dtype=np.float64)
    ideal_surv = None if alpha is None else np.cumprod(np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0), axis=1)
    accepted = np.asarray(accepted, dtype=np.int64)
    sizes = capture_sizes(max_num_seqs)
    rng = np.random.default_rng(seed)
    rows = []
    for c in concurrency:
        extra = float((overhead_ms or {}).get(c, 0.0))
        draws = rng.integers(0, len(accepted), size=(steps, c))
        acc = accepted[draws]  # [steps, c]
        plain = plain_rate(padded_cost(cost, sizes, query_levels(k)), c)
        row = {"concurrency": c, "plain": dict(plain, ms=plain["ms"] + extra, rate=c / (plain["ms"] + extra))}
        for fk in fixed_ks:
            ms = step_ms(padded_cost(cost, sizes, query_levels(fk)), c, c * (1 + fk), need=fk) + extra
            tokens = float(np.mean(np.sum(np.minimum(acc, fk) + 1, axis=1)))
            row[f"fixed:{fk}"] = dict(slots=float(fk), tokens=tokens, ms=ms, rate=tokens / ms)
        priced = padded_cost(cost, sizes, list(range(1, k + 2)))
        def confidences(drawn):  # the survivals the engine would see for the drawn blocks
            return survival(conf[drawn])

        policies = {f"adaptive:{k}": (priced, confidences)}
        if extra:
            policies[f"adaptive:{k} priced overhead"] = (OverheadCost(priced, StepOverhead(extra)), confidences)
        if ideal_surv is not None:
            policies[IDEAL.format(k=k)] = (priced, ideal_surv.__getitem__)
        for name, (policy_cost, survivals_of) in policies.items():
            tokens = ms = slots = predicted = 0.0
            for s in range(steps):
                surv = survivals_of(draws[s])
                b, lengths, width = choose(surv, c, policy_cost)
                tokens += float(np.sum(np.minimum(acc[s], lengths) + 1))
                # what the objective expected of them: the survivals of the slots it verifies
                predicted += c + float(np.sum(np.where(np.arange(k)[None, :] < lengths[:, None], surv, 0.0)))
                # what the step costs: the tables' price of what it ran, plus the host's share
                ms += step_ms(priced, c, c + b, need=width) + extra
                slots += b / c
            row[name] = dict(slots=slots / steps, tokens=tokens / steps, ms=ms / steps, rate=tokens / ms,
                             predicted_tokens=predicted / steps, predicted_rate=predicted / ms)
        row[f"oracle:{k} (knows acceptance)"] = oracle_rate(priced, acc, k, c, extra)
        best = max((n for n in row if n.startswith("fixed:")), key=lambda n: row[n]["rate"], default=None)
        row["adaptive_over_best_fixed"] = row[f"adaptive:{k}"]["rate"] / row[best]["rate"] if best else None
        row["oracle_over_best_fixed"] = row[f"oracle:{k} (knows acceptance)"]["rate"] / row[best]["rate"] \
            if best else None
        if extra:
            row["priced_overhead_over_best_fixed"] = \
                row[f"adaptive:{k} priced overhead"]["rate"] / row[best]["rate"] if best else None
        if ideal_surv is not None:
            row["ideal_over_best_fixed"] = row[IDEAL.format(k=k)]["rate"] / row[best]["rate"] if best else None
        rows.append(row)
    return rows


def slot_auc(conf: np.ndarray, accepted: np.ndarray) -> list[float | None]:
    """Per draft slot j, how well the calibrated confidence tells the blocks whose draft j is
    accepted from those whose is not, among the blocks that reach it (accepted >= j): the area
    under the ROC curve (0.5: no better than chance; 1: perfect), None where one side is empty."""
    out = []
    for j in range(conf.shape[1]):
        reached = accepted >= j
        a = auc(conf[reached, j], accepted[reached] > j)
        out.append(None if np.isnan(a) else a)
    return out


def oracle_rate(cost: GraphPaddedCost, acc: np.ndarray, k: int, c: int, extra: float) -> dict:
    """The objective's choice per drawn step (acc [steps, c]: each block's accepted drafts) with
    survivals that know the outcome: 1 for the accepted drafts, 0 after. It verifies accepted drafts
    only, as many as pay for their verify time (each is one more token), and never a rejected one."""
    tokens = ms = slots = 0.0
    for a in acc:
        surv = (np.arange(k)[None, :] < a[:, None]).astype(np.float64)
        b, lengths, width = choose(surv, c, cost)
        tokens += float(np.sum(np.minimum(a, lengths) + 1))
        ms += step_ms(cost, c, c + b, need=width) + extra
        slots += b / c
    n = len(acc)
    return dict(slots=slots / n, tokens=tokens / n, ms=ms / n, rate=tokens / ms)


def parse_overhead(text: str | None, concurrency: list[int]) -> dict[int, float]:
    """--step-overhead-ms: one number for every C, or C:MS pairs (each C of the replay given once)."""
    if not text:
        return {}
    try:
        if ":" not in text:
            value = float(text)
            got = {c: value for c in concurrency}
        else:
            got = {}
            for part in text.split(","):
                c, ms = part.split(":")
                got[int(c)] = float(ms)
    except ValueError:
        raise SystemExit(f"--step-overhead-ms {text!r}: give a number of ms, or C:MS pairs such as 128:3.0,256:4.4")
    if any(v < 0 for v in got.values()):
        raise SystemExit(f"--step-overhead-ms {text!r}: an overhead is >= 0 ms")
    missing = [c for c in concurrency if c not in got]
    if missing:
        raise SystemExit(f"--step-overhead-ms {text!r} gives no overhead for concurrency {missing}")
    return got


def measured_decode_rates(sweep: dict) -> dict:
    """(arm, C) -> the decode-only steps' tokens per ms the sweep measured, mean over repeats
    (rows carry step_kinds since run 17's fixes; older sweeps give {})."""
    got: dict = {}
    for row in sweep.get("rows", []):
        rate = ((row.get("step_kinds") or {}).get("decode") or {}).get("tokens_per_ms")
        if rate is not None:
            got.setdefault((row["arm"], row["concurrency"]), []).append(rate)
    return {k: sum(v) / len(v) for k, v in got.items()}


def tables_from_log(path: str) -> dict:
    """The cost tables an adaptive server logged (the last such line: a server profiles once)."""
    from adaspec.spec_decode.profiler import TABLES_JSON_PREFIX

    lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if TABLES_JSON_PREFIX in ln]
    if not lines:
        raise SystemExit(f"{path}: no line with {TABLES_JSON_PREFIX.strip()!r} (adaptive servers log it since "
                         "this change; older logs give the tables in words only)")
    return json.loads(lines[-1].split(TABLES_JSON_PREFIX, 1)[1])


def curve_of(sweep: dict, pair: str | None, temperature: float) -> list[float]:
    if pair:
        return [float(x) for x in json.loads(Path(pair).read_text())["heldout"]["T=%g" % temperature]["cond_acceptance"]]
    spec = sweep.get("args", {}).get("synthetic_acceptance")
    if not spec:
        raise SystemExit("the sweep has no synthetic acceptance curve: give --pair pair.json")
    return [float(x) for x in str(spec).split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", nargs="?", help="an offline sweep's JSON with cost_tables")
    ap.add_argument("--server-log", help="instead of a sweep: an adaptive server's log, whose cost tables line "
                    "(profiler.py, \"cost tables (json): ...\") gives the tables (needs --concurrency)")
    ap.add_argument("--pair", help="pair.json whose held-out conditional acceptance is the curve")
    ap.add_argument("--blocks", help="a build's drafter/heldout_blocks.npz: replay over real blocks (see above)")
    ap.add_argument("--steps", type=int, default=200, help="--blocks: steps drawn per concurrency (default 200)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--arm", help="which adaptive arm's tables (default: the first)")
    ap.add_argument("--levels", action="append", help="query-token levels, e.g. 1,3,5,8 (repeatable; "
                    "default: the levels the sweep's commit captured, query_levels(k), and every level 1..k+1)")
    ap.add_argument("--fixed", default="1,3,7", help="fixed k arms to price (default 1,3,7)")
    ap.add_argument("--concurrency", help="default: the sweep's")
    ap.add_argument("--max-num-seqs", type=int, help="the engine's (the graphs' capture sizes); default: the largest C")
    ap.add_argument("--step-overhead-ms", help="--blocks: host time per step beyond the tables, paid by every "
                    "arm: a number, or C:MS pairs (e.g. 128:3.0,256:4.4); adds a row whose policy prices it")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    if a.step_overhead_ms and not a.blocks:
        ap.error("--step-overhead-ms needs --blocks")
    if (a.sweep is None) == (a.server_log is None):
        ap.error("give a sweep's JSON or --server-log LOG (one of them)")
    if a.server_log:
        if not a.concurrency:
            ap.error("--server-log needs --concurrency")
        sweep = {"cost_tables": {a.arm or "adaptive": tables_from_log(a.server_log)}, "args": {}}
        a.sweep = a.server_log
    else:
        sweep = read_json(a.sweep)
    tables = sweep.get("cost_tables") or {}
    if not tables:
        raise SystemExit(f"{a.sweep} has no cost_tables (sweeps record them since 8406820)")
    arm = a.arm or next(iter(tables))
    if arm not in tables:
        raise SystemExit(f"no cost tables for arm {arm!r}; the sweep has {sorted(tables)}")
    conc = [int(x) for x in (a.concurrency or sweep["args"]["concurrency"]).split(",")]
    if a.blocks:
        return replay_blocks_main(a, sweep, tables[arm], arm, conc)
    curve = curve_of(sweep, a.pair, a.temperature)
    k = len(curve)
    level_sets = [[int(x) for x in s.split(",")] for s in a.levels] if a.levels else \
        [[1, 3, 5, 8] if k == 7 else query_levels(k), list(range(1, k + 2))]
    rows = replay(tables[arm], curve, conc, level_sets, [int(x) for x in a.fixed.split(",")],
                  a.max_num_seqs or max(conc))
    print(f"cost tables of {arm} in {a.sweep}; curve {', '.join('%.3f' % x for x in curve)}")
    print("predicted decode-step rate, tokens per ms [slots verified per request, step ms]:")
    names = [n for n in rows[0] if n != "concurrency"]
    for r in rows:
        best = max(names, key=lambda n: r[n]["rate"])
        print(f"C={r['concurrency']}")
        for n in names:
            v = r[n]
            print(f"  {n:<34} {v['rate']:8.2f} [{v['slots']:.2f}, {v['ms']:.2f} ms]{'  <- best' if n == best else ''}")
    measured = measured_decode_rates(sweep)
    if measured:
        print("measured decode-only steps, tokens per ms (mean over repeats; offline_sweep's step_kinds):")
        for (arm_name, c), rate in sorted(measured.items(), key=lambda x: (x[0][1], x[0][0])):
            print(f"  C={c:<5} {arm_name:<12} {rate:8.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"sweep": a.sweep, "arm": arm, "curve": curve, "rows": rows,
                                            "measured_decode_tokens_per_ms": {f"{k[0]} C={k[1]}": v
                                                                              for k, v in measured.items()}}, indent=1))
    return 0


def replay_blocks_main(a, sweep: dict, tables: dict, arm: str, conc: list[int]) -> int:
    key = "T%g" % a.temperature
    with np.load(a.blocks) as blocks:
        if f"{key}_conf" not in blocks.files:
            raise SystemExit(f"{a.blocks} has no blocks at temperature {a.temperature:g} (it has {sorted(blocks.files)})")
        conf, accepted = blocks[f"{key}_conf"], blocks[f"{key}_accepted"]
        alpha = blocks[f"{key}_alpha"] if f"{key}_alpha" in blocks.files else None  # builds since 2026-12-05
    overhead = parse_overhead(a.step_overhead_ms, conc)
    rows = replay_blocks(tables, conf, accepted, conc, [int(x) for x in a.fixed.split(",")],
                         a.max_num_seqs or max(conc), steps=a.steps, overhead_ms=overhead, alpha=alpha)
    print(f"cost tables of {arm} in {a.sweep}; {len(accepted)} blocks of {a.blocks} at T={a.temperature:g} "
          f"(walk tau {float(np.mean(accepted + 1.0)):.2f}); {a.steps} steps drawn per C"
          + (f"; host overhead per step (ms): {', '.join(f'C={c}: {v:g}' for c, v in overhead.items())}" if overhead else ""))
    auc = slot_auc(np.asarray(conf, dtype=np.float64), np.asarray(accepted, dtype=np.int64))

    def fmt(vals):
        return ", ".join("-" if v is None else f"{v:.3f}" for v in vals)

    print("how well the confidences tell accepted drafts from rejected ones, per slot (ROC AUC among the "
          "blocks that reach it): " + fmt(auc))
    ideal_auc = None
    if alpha is not None:
        ideal_auc = slot_auc(np.asarray(alpha, dtype=np.float64), np.asarray(accepted, dtype=np.int64))
        print("the same for the acceptance probabilities themselves (the most any confidence can tell): "
              + fmt(ideal_auc))
    print("realized decode-step rate, tokens per ms [slots verified per request, step ms]:")
    for r in rows:
        names = [n for n in r if not n.endswith("over_best_fixed") and n != "concurrency"]
        best = max((n for n in names if not n.startswith(("oracle", "ideal"))), key=lambda n: r[n]["rate"])
        priced, ideal = r.get("priced_overhead_over_best_fixed"), r.get("ideal_over_best_fixed")
        print(f"C={r['concurrency']}  (adaptive / best fixed: {r['adaptive_over_best_fixed']:.3f}"
              + (f"; priced overhead: {priced:.3f}" if priced is not None else "")
              + (f"; ideal / best fixed: {ideal:.3f}" if ideal is not None else "")
              + f"; oracle / best fixed: {r['oracle_over_best_fixed']:.3f})")
        for n in names:
            v = r[n]
            what = "probabilities" if n.startswith("ideal") else "confidences"
            expected = f" (the {what} expected {v['predicted_rate']:.2f})" if "predicted_rate" in v else ""
            print(f"  {n:<28} {v['rate']:8.2f} [{v['slots']:.2f}, {v['ms']:.2f} ms]{expected}{'  <- best' if n == best else ''}")
    if a.json:
        Path(a.json).write_text(json.dumps({"sweep": a.sweep, "arm": arm, "blocks": a.blocks,
                                            "temperature": a.temperature, "step_overhead_ms": overhead,
                                            "slot_auc": auc, "slot_auc_ideal": ideal_auc, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
