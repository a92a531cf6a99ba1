"""CPU probe: held-out acceptance at T > 0 with probabilistic drafts against greedy drafts.

At T = 1 the drafter samples each of its k slots (draft_sample_method "probabilistic"): on the
H200 that is more kernels a slot in the propose graph than an argmax (softmax, inverse-CDF cumsum
and search, the keyed hash, the clamps: +15-20 ops a slot counted on the CPU), part of why the
graphed step at one request takes 2.06 ms at T = 1 against 1.80 ms at T = 0 (run 36, fixed:7,
whose verify also samples at T = 1). Greedy drafts would save those kernels
and stay lossless (rejection sampling with a one-hot proposal accepts slot j with probability
p_j(draft)), but accept less: this probe measures by how much, teacher-forced on the target's own
T-sampled continuations of eval-code prompts (the held-out evaluation's method, drafter_eval.py):
per slot, sum_v min(p, q) for probabilistic drafts and p(argmax q) for greedy ones, and the
expected accepted length 1 + sum_j prod_{i<=j} alpha_i of each.

    python3 benchmarks/probes/draft_sampling_acceptance.py [--model tiny] [--prompts 48] [--gen 128]
        [--temperature 1]

--model: an embedded target with a default drafter (the tiny pair), or a target directory with
--drafter DIR (a code-0.6b build on the GPU machine, --device cuda).
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from adaspec import LLM, SamplingParams  # noqa: E402
from adaspec.models.drafter import load_drafter  # noqa: E402
from adaspec.models.loader import load_target, model_dir  # noqa: E402
from adaspec.models.registry import DEFAULT_DRAFTERS  # noqa: E402
from adaspec.train.drafter_eval import load_prompts  # noqa: E402
from adaspec.train.drafter_loss import block_forward  # noqa: E402


def expected_tau(alpha: np.ndarray) -> float:
    return float((1 + np.cumprod(alpha, axis=1).sum(1)).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the model's default drafter)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--gen", type=int, default=128, help="tokens the target generates per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0: at T = 0 both draft methods are the argmax")
    device = torch.device(args.device)
    llm = LLM(args.model, dtype="float32", device=args.device)
    prompts = load_prompts("eval-code", llm.llm_engine.tokenizer, limit=args.prompts, max_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.gen, seed=3,
                                                ignore_eos=True))
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    target, tcfg = load_target(model_dir(args.model), dtype="float32", device=device)
    drafter, _ = load_drafter(args.drafter or DEFAULT_DRAFTERS[args.model], target_cfg=tcfg, dtype="float32",
                              device=device)
    k = drafter.block_size
    prob, greedy = [], []
    for p, s in zip(prompts, seqs):
        anchors = list(range(len(p), len(s) - k))  # slot k's target token must exist
        if not anchors:
            continue
        with torch.no_grad():
            bb = block_forward(target, drafter, torch.tensor([s], device=device), torch.tensor([anchors], device=device))
        q = torch.softmax(bb.logits[0].float() / args.temperature, -1)
        pt = torch.softmax(bb.target_logits[0].float() / args.temperature, -1)
        prob.append(torch.minimum(pt, q).sum(-1).clamp(0, 1).cpu().numpy())
        greedy.append(pt.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1).cpu().numpy())
    prob, greedy = np.concatenate(prob), np.concatenate(greedy)
    print(f"{args.model}, T = {args.temperature:g}, k = {k}, {len(prob)} blocks of {len(seqs)} continuations")
    for name, a in (("probabilistic", prob), ("greedy", greedy)):
        print(f"  {name:14s} per-slot acceptance {[round(float(x), 3) for x in a.mean(0)]}  expected tau {expected_tau(a):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
