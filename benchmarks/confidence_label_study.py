"""Which label should the confidence head learn for greedy decoding? The DSpark loss trains it on one
label for every temperature, the T = 1 acceptance 1 - TV(p, q) (train/drafter_loss.py), and STS
calibration then scales each slot's logit per temperature, which keeps each slot's ranking. At T = 0
a draft is accepted when the drafter's argmax is the target's, a different event, and the ranking
is what the adaptive policy lives on (replay_policy.py's ideal row: the confidences' per-slot AUC
0.78-0.83 at T = 0 left 16% of the throughput at 256 requests on H100 run 50's pair).

On the target's greedy continuations of eval-code prompts (teacher forcing: every anchor, every
slot), this fits the head's own form (one linear layer on [h_j ; W1[x_{j-1}]], shared by the slots)
twice on the same rows, once on the soft T = 1 label and once on the greedy event, plus a wider
head (one hidden layer) on the greedy event, and reports each slot's ROC AUC for the greedy event
on held-out sequences, among the blocks whose earlier slots were accepted (as the replay counts),
beside the drafter's own head.

    python3 benchmarks/confidence_label_study.py --target tiny --drafter tiny-dspark \\
        [--num-prompts 120] [--gen-len 96] [--steps 300] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaspec.commands.eval import load_pair  # noqa: E402
from adaspec.spec_decode.calibration import auc  # noqa: E402
from adaspec.train.drafter_eval import generate_eval_set  # noqa: E402
from adaspec.train.drafter_loss import block_forward  # noqa: E402


@torch.no_grad()
def block_rows(target, drafter, seqs: list[list[int]], starts: list[int], batch_size: int = 8):
    """Every scored block of every sequence: (features [n, k, d + r], greedy event [n, k],
    soft T = 1 label [n, k], the drafter's confidence logits [n, k], sequence index [n])."""
    k = drafter.block_size
    captured = {}
    hook = drafter.norm.register_forward_hook(lambda mod, inp, out: captured.__setitem__("h", out))
    feats, greedy, soft, conf, seq_of = [], [], [], [], []
    try:
        for i in range(0, len(seqs), batch_size):
            batch = seqs[i:i + batch_size]
            anchors = [list(range(max(starts[i + b], 0), len(s) - k)) for b, s in enumerate(batch)]
            if not any(anchors):
                continue
            T, A = max(len(s) for s in batch), max(len(a) for a in anchors)
            ids = torch.zeros(len(batch), T, dtype=torch.long)
            anc = torch.zeros(len(batch), A, dtype=torch.long)
            ok = torch.zeros(len(batch), A, dtype=torch.bool)
            for b, (s, a) in enumerate(zip(batch, anchors)):
                ids[b, :len(s)] = torch.tensor(s)
                if a:
                    anc[b, :len(a)], anc[b, len(a):], ok[b, :len(a)] = torch.tensor(a), a[-1], True
            bb = block_forward(target, drafter, ids, anc)
            h = captured["h"].reshape(*anc.shape, k, -1).float()
            pos = anc.unsqueeze(-1) + torch.arange(k)
            prev = ids.gather(1, pos.reshape(len(batch), -1)).reshape(pos.shape)
            x = torch.cat([h, drafter.markov_head.markov_w1(prev).float()], -1)
            q, p = torch.softmax(bb.logits, -1), torch.softmax(bb.target_logits, -1)
            feats.append(x[ok])
            greedy.append((bb.logits.argmax(-1) == bb.target_logits.argmax(-1)).float()[ok])
            soft.append((1.0 - 0.5 * (q - p).abs().sum(-1)).clamp(0, 1)[ok])
            conf.append(bb.conf_logits.float()[ok])
            seq_of.append(torch.arange(i, i + len(batch)).repeat_interleave(ok.sum(1)))
    finally:
        hook.remove()
    return torch.cat(feats), torch.cat(greedy), torch.cat(soft), torch.cat(conf), torch.cat(seq_of)


class _Standardize(torch.nn.Module):
    def __init__(self, mu: torch.Tensor, sd: torch.Tensor):
        super().__init__()
        self.mu, self.sd = mu, sd

    def forward(self, x):
        return (x - self.mu) / self.sd


def _fit(net: torch.nn.Module, x: torch.Tensor, label: torch.Tensor, steps: int, lr: float,
         weight_decay: float = 0.0) -> torch.nn.Module:
    """net fitted by full-batch Adam on BCE against label (soft or 0/1), on features standardized
    over the fitted rows; returned with the standardization in front, for raw features."""
    std = _Standardize(x.mean((0, 1)), x.std((0, 1)).clamp_min(1e-6))
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
    z = std(x)
    for _ in range(steps):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(net(z).squeeze(-1), label).backward()
        opt.step()
    return torch.nn.Sequential(std, net)


def fit_head(x: torch.Tensor, label: torch.Tensor, steps: int, lr: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """One linear head shared by the slots: the confidence head's form."""
    torch.manual_seed(seed)
    return _fit(torch.nn.Linear(x.shape[-1], 1), x, label, steps, lr)


def fit_mlp(x: torch.Tensor, label: torch.Tensor, steps: int, hidden: int = 256, lr: float = 0.01,
            seed: int = 0) -> torch.nn.Module:
    """A wider head than DSpark's: one hidden layer of `hidden` SiLU units on the same features;
    whether a head that can read more of the drafter's state ranks better."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[-1], hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, 1))
    return _fit(net, x, label, steps, lr, weight_decay=1e-4)


def slot_aucs(score: np.ndarray, event: np.ndarray) -> list[float]:
    """Per slot j, the AUC of score for the event among the blocks whose slots before j all hold."""
    reached = np.cumprod(np.concatenate([np.ones((event.shape[0], 1)), event[:, :-1]], 1), 1) > 0
    return [auc(score[reached[:, j], j], event[reached[:, j], j]) for j in range(event.shape[1])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--drafter", default="tiny-dspark")
    ap.add_argument("--prompts", default="eval-code")
    ap.add_argument("--num-prompts", type=int, default=120)
    ap.add_argument("--max-prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--steps", type=int, default=300, help="Adam steps per fitted head")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.num_prompts < 4:
        ap.error("--num-prompts must be at least 4 (half the sequences fit, half are held out)")
    target, _, drafter, _, prompts = load_pair(SimpleNamespace(
        target=args.target, drafter=args.drafter, device=args.device, prompts=args.prompts,
        num_prompts=args.num_prompts, max_prompt_len=args.max_prompt_len, skip_prompts=0))
    seqs, starts = generate_eval_set(target, prompts, args.gen_len, 0.0)
    x, greedy, soft, conf, seq_of = block_rows(target, drafter, seqs, starts)
    fit = (seq_of % 2 == 0).numpy()  # every other sequence: no block of a held-out one is fitted
    heads = {"soft T = 1 label (the DSpark loss's)": soft, "greedy event": greedy}
    scores = {"the drafter's own head": conf.numpy()[~fit]}
    for name, label in heads.items():
        head = fit_head(x[fit], label[fit], args.steps)
        with torch.no_grad():
            scores[f"refitted on the {name}"] = head(x[~fit]).squeeze(-1).numpy()
    mlp = fit_mlp(x[fit], greedy[fit], args.steps)
    with torch.no_grad():
        scores["a one-hidden-layer MLP on the greedy event"] = mlp(x[~fit]).squeeze(-1).numpy()
    event = greedy.numpy()[~fit]
    rows = {name: slot_aucs(s, event) for name, s in scores.items()}
    print(f"{args.target} / {args.drafter}: {int(fit.sum())} fitted and {int((~fit).sum())} held-out blocks of "
          f"{len(seqs)} greedy continuations ({args.gen_len} tokens); held-out greedy acceptance per slot "
          + " ".join(f"{v:.2f}" for v in event.mean(0)))
    print("per-slot ROC AUC for the greedy event, among the blocks that reach the slot:")
    for name, r in rows.items():
        print(f"  {name:52s} " + " ".join(f"{v:.3f}" for v in r) + f"   mean {np.nanmean(r):.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "blocks_fitted": int(fit.sum()),
                                         "blocks_held_out": int((~fit).sum()), "slot_auc": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
