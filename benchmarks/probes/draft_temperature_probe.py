"""Would a draft temperature raise acceptance at T > 0? Rejection sampling is exact for any q, so
the drafter may sample from softmax(z / (T * t)) instead of softmax(z / T); this probe measures, on
the target's own continuations of eval-code prompts (teacher-forced, as adaspec/train/drafter_eval.py
measures held-out acceptance), each slot's acceptance sum_v min(p, q_t) and the expected accepted
length for a grid of t. A drafter trained on the total-variation loss should already sit near t = 1.

    python3 benchmarks/probes/draft_temperature_probe.py [--target tiny] [--drafter tiny-dspark]
        [--prompts 48] [--gen-len 96] [--temperature 1] [--factors 0.6,0.7,0.8,0.9,1,1.1,1.25] [--device cpu]

Prints one line per t: the mean acceptance per slot and 1 + the expected accepted drafts.
"""
from __future__ import annotations

import argparse

import torch

from adaspec.models.drafter import load_drafter
from adaspec.models.loader import load_target
from adaspec.models.registry import resolve_model_path
from adaspec.models.tokenizer import Tokenizer
from adaspec.train.drafter_eval import generate_eval_set, load_prompts, teacher_forced_batch
from adaspec.train.drafter_loss import block_forward


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--drafter", default="tiny-dspark")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--factors", default="0.6,0.7,0.8,0.9,1,1.1,1.25")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.temperature <= 0:
        ap.error("--temperature must be > 0: at T = 0 the drafts are argmaxes, which a temperature does not move")
    factors = [float(f) for f in args.factors.split(",")]
    tpath = resolve_model_path(args.target)
    target, tcfg = load_target(tpath, dtype=torch.float32, device=args.device)
    drafter, _ = load_drafter(args.drafter, tcfg, dtype=torch.float32, device=args.device)
    prompts = load_prompts("eval-code", Tokenizer.from_dir(tpath), limit=args.prompts, max_len=128)
    seqs, starts = generate_eval_set(target, prompts, args.gen_len, args.temperature, seed=1, batch_size=len(prompts))
    K = drafter.block_size
    alphas = {f: [] for f in factors}
    for i in range(0, len(seqs), args.batch):
        ids, at, ok = teacher_forced_batch(seqs[i:i + args.batch], starts[i:i + args.batch], K)
        if at.shape[1] == 0:
            continue
        bb = block_forward(target, drafter, ids.to(args.device), at.to(args.device))
        ok = ok.to(args.device)
        p = torch.softmax(bb.target_logits[ok] / args.temperature, -1)
        for f in factors:
            q = torch.softmax(bb.logits[ok] / (args.temperature * f), -1)
            alphas[f].append(torch.minimum(p, q).sum(-1).clamp(0, 1).cpu())
    blocks = torch.cat(alphas[factors[0]]).shape[0]
    print(f"{args.target} / {args.drafter}, T = {args.temperature:g}, {len(prompts)} prompts x {args.gen_len} tokens, "
          f"{blocks} blocks")
    for f in factors:
        a = torch.cat(alphas[f])
        expected = 1 + torch.cumprod(a, 1).mean(0).sum().item()
        print(f"  t = {f:<5g} acceptance per slot {' '.join(f'{x:.3f}' for x in a.mean(0).tolist())}"
              f"   1 + E[accepted] {expected:.3f}")


if __name__ == "__main__":
    main()
