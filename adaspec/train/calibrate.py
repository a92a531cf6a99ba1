"""`adaspec train calibrate`: Sequential Temperature Scaling of a drafter's confidences.

Measures per-block acceptance teacher-forced on target-generated continuations of held-out
prompts (as `adaspec eval drafter` does), splits the prompts in two halves (fit / report),
fits one temperature per slot on the fit half (adaspec.spec_decode.calibration), and reports, on
the other half, per-slot ECE of the cumulative survival prod c_i against observed prefix
acceptance before and after, plus AUC. Temperatures go into the drafter's config.json under
our own key: ``adaspec.confidence_temperatures`` (fitted at T > 0, used for sampled requests)
or, with --temperature 0, ``adaspec.confidence_temperatures_greedy`` (used for greedy
requests); propose() applies them.

At T > 0 the observed accepted length is sampled from the per-slot acceptance
probabilities; --samples draws several per block to cut the label noise.
"""
from __future__ import annotations

import json
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


def fit_and_report(fit, rep, n_bins: int = 15) -> dict:
    """fit / rep: BlockResults. -> temperatures and before/after metrics on `rep`."""
    from adaspec.spec_decode.calibration import (auc, ece, per_slot_metrics, prefix_labels,
                                          sequential_temperature_scaling, survival_from_logits)

    temps = sequential_temperature_scaling(fit.conf_logits, fit.accepted, n_bins=n_bins)
    k = rep.conf_logits.shape[1]
    labels, _ = prefix_labels(rep.accepted, k)
    before = survival_from_logits(rep.conf_logits)
    after = survival_from_logits(rep.conf_logits, temps)
    return {
        "temperatures": [float(t) for t in temps],
        "before": {"ece": ece(before, labels, n_bins), "auc": auc(before, labels),
                   "per_slot": per_slot_metrics(before, rep.accepted, n_bins)},
        "after": {"ece": ece(after, labels, n_bins), "auc": auc(after, labels),
                  "per_slot": per_slot_metrics(after, rep.accepted, n_bins)},
        "_curves": {"raw": (before, labels), "calibrated": (after, labels)},
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
    seqs, starts = generate_eval_set(target, prompts, args.gen_len, args.temperature, seed=args.seed)
    half = len(seqs) // 2  # fit on the first half of the prompts, report on the second
    status("scoring the drafter's block at every generated position")
    fit = measure_blocks(target, drafter, seqs[:half], starts[:half], args.temperature, batch_size=args.batch_size,
                         seed=args.seed)
    rep = measure_blocks(target, drafter, seqs[half:], starts[half:], args.temperature, batch_size=args.batch_size,
                         seed=args.seed + 1)
    out = fit_and_report(replicate(fit, args.samples, args.seed), replicate(rep, args.samples, args.seed + 1))
    curves = out.pop("_curves")
    plot_reliability(curves, plot, title=f"drafter survival vs prefix acceptance (T={args.temperature:g})")
    out.update(prompts=args.prompts, num_prompts=len(prompts), temperature=args.temperature,
               fit_blocks=int(fit.alpha.shape[0]), report_blocks=int(rep.alpha.shape[0]), plot=str(plot))
    k = len(out["temperatures"])
    print("slot  T_j     ECE before  ECE after  AUC")
    for j in range(k):
        b, a = out["before"]["per_slot"][j], out["after"]["per_slot"][j]
        print(f"{j + 1:>4}  {out['temperatures'][j]:5.3f}  {b['ece']:10.4f}  {a['ece']:9.4f}  {a['auc']:.3f}")
    print(f"all   ECE {out['before']['ece']:.4f} -> {out['after']['ece']:.4f}, AUC {out['after']['auc']:.3f}")
    if drafter_dir is not None:
        greedy = args.temperature <= 0
        save_drafter_config(with_temperatures(dcfg, out["temperatures"], greedy=greedy), drafter_dir)
        (drafter_dir / ("calibration-greedy.json" if greedy else "calibration.json")).write_text(
            json.dumps(out, indent=2) + "\n")
        print(f"temperatures saved in {drafter_dir / 'config.json'}")
    return 0
