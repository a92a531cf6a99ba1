"""`adaspec train calibrate`: Sequential Temperature Scaling of a drafter's confidences.

Measures per-block acceptance teacher-forced on target-generated continuations of held-out
prompts (as `adaspec eval drafter` does), splits the prompts in two halves by a permutation
seeded by --seed (split_prompts: the prompt files are in source-file order, so a first / second
half would be different files), and cross-fits one temperature per slot
(adaspec.spec_decode.calibration.cross_fit_sts): fitted on one half, scored on the other, both
ways. The temperatures are adopted only when they lower the out-of-fold ECE of the cumulative
survival prod c_i against observed prefix acceptance on both halves; adopted, they are the ones
fitted on both halves together; not adopted, 1.0 at every slot (the report and the JSON say
why). Reported, as means over the two halves, each scored with temperatures fitted on the other
(never on the data they were fitted on): per-slot ECE and AUC before (raw) and after (what is
saved: the out-of-fold fit when adopted, raw when not), and the out-of-fold fit's figures
either way. Temperatures go into the drafter's config.json under our own key:
``adaspec.confidence_temperatures`` (fitted at T > 0, used for sampled requests) or, with
--temperature 0, ``adaspec.confidence_temperatures_greedy`` (used for greedy requests);
propose() applies them.

At T > 0 the observed accepted length is sampled from the per-slot acceptance
probabilities; --samples draws several per block to cut the label noise (a block's draws stay
in its prompt's half).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from adaspec.commands.eval import add_drafter_eval_args
from adaspec.commands.writable import OutputPath


def add_subparser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit per-slot confidence temperatures of a drafter (STS)",
                       description=__doc__)
    add_drafter_eval_args(p, num_prompts=200)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature the acceptance is measured at")
    p.add_argument("--samples", type=int, default=4, help="accepted-length samples per block at T > 0")
    p.add_argument("--plot", type=OutputPath(Path),
                   help="reliability PNG (default: DRAFTER/calibration.png, or calibration-greedy.png at T = 0)")
    p.add_argument("--dry-run", action="store_true", help="report only, leave config.json as it is")
    p.set_defaults(func=run)


def output_paths(args) -> tuple[Path, Path | None]:
    """-> the plot path and (None with --dry-run) the drafter directory whose config.json is
    rewritten. Refused before any work when either lies inside the installed package."""
    from adaspec.commands.writable import refuse_package_path
    from adaspec.models.loader import model_dir

    drafter_dir = model_dir(args.drafter)
    plot = args.plot or drafter_dir / ("calibration-greedy.png" if args.temperature <= 0 else "calibration.png")
    if not args.dry_run:
        refuse_package_path(drafter_dir, "--drafter", "calibrating rewrites the drafter's config.json: copy the "
                            "directory elsewhere and calibrate the copy, or only report with --dry-run")
    if not args.plot:
        refuse_package_path(plot, "the reliability plot (default: in the drafter directory)",
                            "set --plot to a path outside it")
    return plot, None if args.dry_run else drafter_dir


def split_prompts(n: int, seed: int) -> tuple[list[int], list[int]]:
    """-> (half A, half B): the indices of n prompts split by a permutation seeded by `seed`, A
    its first n // 2, each half in the prompts' order. The packaged prompt files are in
    source-file order (eval-code: one test file after another), so the first and second half
    would be different files, a distribution shift between the halves; a permutation makes both
    halves samples of the same set. Deterministic in `seed`."""
    import numpy as np

    perm = np.random.default_rng(seed).permutation(n)
    return sorted(perm[: n // 2].tolist()), sorted(perm[n // 2:].tolist())


def _fold_metrics(surv, accepted, folds, n_bins: int) -> dict:
    """ECE / AUC (all slots, and per slot) of `surv` on each fold, averaged over the folds, as
    cross_fit_sts averages its ECEs (so "ece" here is its ece_raw / ece_fitted)."""
    import numpy as np

    from adaspec.spec_decode.calibration import auc, ece, per_slot_metrics, prefix_labels

    k = surv.shape[1]
    parts = []
    for f in (0, 1):
        m = folds == f
        if m.any():
            labels, _ = prefix_labels(accepted[m], k)
            parts.append({"ece": ece(surv[m], labels, n_bins), "auc": auc(surv[m], labels),
                          "per_slot": per_slot_metrics(surv[m], accepted[m], n_bins)})
    if not parts:
        return {"ece": float("nan"), "auc": float("nan"), "per_slot": []}
    return {"ece": float(np.mean([p["ece"] for p in parts])), "auc": float(np.mean([p["auc"] for p in parts])),
            "per_slot": [{"position": j + 1, "n": sum(p["per_slot"][j]["n"] for p in parts),
                          "ece": float(np.mean([p["per_slot"][j]["ece"] for p in parts])),
                          "auc": float(np.mean([p["per_slot"][j]["auc"] for p in parts]))} for j in range(k)]}


def fit_and_report(a, b, n_bins: int = 15) -> dict:
    """a, b: BlockResults of the two prompt halves. Cross-fitted STS (cross_fit_sts) -> the
    temperatures to save (identity when not adopted), the decision, and metrics as means over the
    halves, each half scored with temperatures fitted on the other: "before" raw, "fitted" the
    out-of-fold fit, "after" the figures of the temperatures saved: adopted, the fitted figures
    (the out-of-sample estimate for the temperatures fitted on both halves, which are scored on
    no data, all of it being theirs); not adopted, the raw ones. No figure is scored on the data
    its temperatures were fitted on."""
    import numpy as np

    from adaspec.spec_decode.calibration import cross_fit_sts, prefix_labels, survival_from_logits

    both = a.concat(b)
    folds = np.r_[np.zeros(len(a.accepted), np.int64), np.ones(len(b.accepted), np.int64)]
    cf = cross_fit_sts(both.conf_logits, both.accepted, folds, n_bins=n_bins)
    k = both.conf_logits.shape[1]
    raw = survival_from_logits(both.conf_logits)
    oof = raw.copy()  # each half with the temperatures fitted on the other
    for f, part in enumerate(cf["folds"]):
        if part["temperatures"] is not None:
            oof[folds == f] = survival_from_logits(both.conf_logits[folds == f], part["temperatures"])
    labels, _ = prefix_labels(both.accepted, k)
    before, fitted = _fold_metrics(raw, both.accepted, folds, n_bins), _fold_metrics(oof, both.accepted, folds, n_bins)
    return {
        "temperatures": cf["temperatures"],
        "adopted": cf["adopted"],
        "reason": cf["reason"],
        "fitted_temperatures": cf["fitted_temperatures"],
        "before": before,
        "after": fitted if cf["adopted"] else before,
        "fitted": fitted,
        "folds": cf["folds"],
        "_curves": {"raw": (raw, labels),
                    "fitted, out of fold" + ("" if cf["adopted"] else " (not adopted)"): (oof, labels)},
    }


def replicate(res, samples: int, seed: int):
    """At T > 0: `samples` independent accepted-length draws per block."""
    import numpy as np
    import torch

    from adaspec.train.drafter_eval import BlockResults, sample_accepted

    if res.temperature <= 0 or samples <= 1:
        return res
    gen = torch.Generator().manual_seed(seed)
    acc = np.concatenate([sample_accepted(res.alpha, gen) for _ in range(samples)])
    seq = None
    if res.seq is not None:  # each draw's rows as sequences of their own
        width = int(res.seq.max()) + 1 if len(res.seq) else 0
        seq = np.concatenate([res.seq + d * width for d in range(samples)])
    return BlockResults(np.tile(res.conf_logits, (samples, 1)), np.tile(res.alpha, (samples, 1)), acc, res.temperature,
                        seq)


def run(args) -> int:
    from adaspec.commands.eval import load_pair, status
    from adaspec.models.drafter import save_drafter_config, with_temperatures
    from adaspec.spec_decode.calibration import plot_reliability
    from adaspec.train.drafter_eval import generate_eval_set, measure_blocks

    plot, drafter_dir = output_paths(args)
    target, _, drafter, dcfg, prompts = load_pair(args)
    status(f"the target generates {args.gen_len} tokens for each of {len(prompts)} prompts at T={args.temperature:g}")
    t0 = time.perf_counter()
    seqs, starts = generate_eval_set(target, prompts, args.gen_len, args.temperature, seed=args.seed)
    half_a, half_b = split_prompts(len(seqs), args.seed)  # same distribution in both halves
    status(f"generated in {time.perf_counter() - t0:.1f} s; scoring the drafter's block at every generated position")
    t0 = time.perf_counter()
    a = measure_blocks(target, drafter, [seqs[i] for i in half_a], [starts[i] for i in half_a], args.temperature,
                       batch_size=args.batch_size, seed=args.seed)
    b = measure_blocks(target, drafter, [seqs[i] for i in half_b], [starts[i] for i in half_b], args.temperature,
                       batch_size=args.batch_size, seed=args.seed + 1)
    status(f"scored in {time.perf_counter() - t0:.1f} s; fitting")
    out = fit_and_report(replicate(a, args.samples, args.seed), replicate(b, args.samples, args.seed + 1))
    curves = out.pop("_curves")
    plot_reliability(curves, plot, title=f"drafter survival vs prefix acceptance (T={args.temperature:g})")
    # fit_blocks / report_blocks: the two halves' blocks (each is fitted on and reported on, crosswise)
    out.update(prompts=args.prompts, num_prompts=len(prompts), temperature=args.temperature,
               fit_blocks=int(a.alpha.shape[0]), report_blocks=int(b.alpha.shape[0]), plot=str(plot))
    k = len(out["temperatures"])
    print("cross-fitted on two halves of the prompts, each scored with the temperatures fitted on the other")
    print("slot  fitted T_j  ECE raw  ECE fitted  AUC")
    for j in range(k):
        b_, f_ = out["before"]["per_slot"][j], out["fitted"]["per_slot"][j]
        print(f"{j + 1:>4}  {out['fitted_temperatures'][j]:10.3f}  {b_['ece']:7.4f}  {f_['ece']:10.4f}  {f_['auc']:.3f}")
    print(f"all   ECE raw {out['before']['ece']:.4f}, fitted {out['fitted']['ece']:.4f} (out of fold), "
          f"AUC {out['fitted']['auc']:.3f}")
    if out["adopted"]:
        print(f"adopted: {out['reason']}; the temperatures saved are those fitted on both halves")
    else:
        print(f"NOT adopted: {out['reason']}; temperatures kept at 1.0")
    print(f"all   ECE {out['before']['ece']:.4f} -> {out['after']['ece']:.4f} with the temperatures saved "
          + ("(estimated out of fold)" if out["adopted"] else "(1.0: raw)"))
    if drafter_dir is not None:
        greedy = args.temperature <= 0
        save_drafter_config(with_temperatures(dcfg, out["temperatures"], greedy=greedy), drafter_dir)
        (drafter_dir / ("calibration-greedy.json" if greedy else "calibration.json")).write_text(
            json.dumps(out, indent=2) + "\n")
        print(f"temperatures saved in {drafter_dir / 'config.json'}")
    return 0
