"""Offline drafter evaluation: teacher-forced per-block acceptance on target-generated text.

1. The target generates a continuation of each prompt (at the evaluation temperature).
2. Every position a of the continuation (and the last prompt token) is an anchor: the drafter
   proposes its block from the context before a, exactly as at serving time.
3. Acceptance, slot by slot, against the target on the same text:
   - T = 0: slot j is accepted iff the draft equals the target's argmax. Exact, not an
     approximation: slot j only matters when drafts 1..j-1 matched, and then they ARE the
     text's tokens (a greedy continuation is the argmax chain), so the teacher-forced Markov
     input is the one the drafter would have used.
   - T > 0: alpha_j = sum_v min(p_j, q_j) (the probability rejection sampling accepts slot j,
     both distributions processed with the same temperature), with teacher-forced prefixes;
     reported as the expected survival prod alpha and as a sampled accepted length.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adaspec.errors import AdaspecError

PROMPT_SETS = {"eval-code": Path(__file__).resolve().parent.parent / "assets" / "prompts" / "eval-code.jsonl"}


def load_prompts(spec: str, tokenizer, limit: int | None = None, max_len: int | None = None,
                 skip: int = 0) -> list[list[int]]:
    """'eval-code' (shipped), a .jsonl file ("prompt" | "text" | "messages" per line), or a .npy
    [N, P] of token ids. skip: leave out the set's first prompts (e.g. those a held-out
    evaluation uses, so that a calibration on the rest stays disjoint from it)."""
    path = PROMPT_SETS.get(spec, Path(spec))
    if not path.is_file():
        raise AdaspecError(f"prompt set not found: {spec} (looked at {path})")
    if path.suffix == ".npy":
        out = [list(map(int, r)) for r in np.load(path)]
    else:
        out = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if "messages" in rec:
                    text = tokenizer.apply_chat_template(rec["messages"], add_generation_prompt=True)
                else:
                    text = rec.get("prompt", rec.get("text"))
                if not isinstance(text, str):
                    raise AdaspecError(f"{path}: each line needs a 'prompt', 'text' or 'messages' field")
                out.append(tokenizer.encode(text))
    out = [p[-max_len:] if max_len else p for p in out if p]
    if skip < 0:
        raise AdaspecError(f"--skip-prompts must be >= 0, got {skip}")
    if skip >= len(out):
        raise AdaspecError(f"prompt set {spec} has {len(out)} prompts: skipping the first {skip} leaves none")
    out = out[skip:]
    return out[:limit] if limit else out


@dataclass
class BlockResults:
    """One row per evaluated block (anchor)."""

    conf_logits: np.ndarray  # [N, k] raw confidence logits
    alpha: np.ndarray  # [N, k] per-slot acceptance probability given the prefix (0/1 at T=0)
    accepted: np.ndarray  # [N] accepted length (exact at T=0, one sample at T>0)
    temperature: float
    # [N] the sequence of each row; a sequence's rows are its consecutive anchors, in order (None:
    # unknown, and no decoding walk: walk_tau)
    seq: np.ndarray | None = None

    def concat(self, other: "BlockResults") -> "BlockResults":
        seq = None
        if self.seq is not None and other.seq is not None:
            seq = np.concatenate([self.seq, other.seq + (self.seq.max() + 1 if len(self.seq) else 0)])
        return BlockResults(np.concatenate([self.conf_logits, other.conf_logits]),
                            np.concatenate([self.alpha, other.alpha]),
                            np.concatenate([self.accepted, other.accepted]), self.temperature, seq)


def walk_blocks(accepted: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Indices of the blocks decoding's walk reaches (see walk_tau): the anchors an engine drafts
    from, each right after the previous block's accepted drafts and bonus token."""
    out = []
    for s in np.unique(seq):
        rows = np.flatnonzero(seq == s)
        i = 0
        while i < len(rows):
            out.append(rows[i])
            i += int(accepted[rows[i]]) + 1
    return np.asarray(out, dtype=np.int64)


def walk_tau(accepted: np.ndarray, seq: np.ndarray) -> float:
    """Tokens per step of decoding each sequence as an engine does: a block at the first anchor,
    then at the anchor right after its accepted drafts and bonus token, and so on (bonus included).
    tau averages over EVERY anchor; an engine drafts only from the positions its walk reaches, which
    sit right after a rejection (the target's correction), so this is what an engine can realize."""
    reached = walk_blocks(accepted, seq)
    return float(np.mean(accepted[reached] + 1.0)) if len(reached) else float("nan")


def teacher_forced_batch(batch: list[list[int]], starts: list[int], K: int):
    """-> (ids [B, T] zero-padded, anchors [B, A], mask [B, A]): every position from starts[b]
    whose block of K tokens lies inside sequence b is an anchor; shorter rows are padded with
    their last anchor (computed, then dropped by the mask)."""
    ids = torch.zeros(len(batch), max(len(s) for s in batch), dtype=torch.long)
    anchors = []
    for b, s in enumerate(batch):
        ids[b, : len(s)] = torch.tensor(s)
        anchors.append(list(range(max(starts[b], 0), len(s) - K)))  # slot K's token must exist
    A = max(len(a) for a in anchors)
    anc = torch.zeros(len(batch), A, dtype=torch.long)
    ok = torch.zeros(len(batch), A, dtype=torch.bool)
    for b, a in enumerate(anchors):
        if a:
            anc[b, : len(a)], anc[b, len(a):], ok[b, : len(a)] = torch.tensor(a), a[-1], True
    return ids, anc, ok


@torch.no_grad()
def measure_blocks(target, drafter, seqs: list[list[int]], starts: list[int], temperature: float, k: int | None = None,
                   batch_size: int = 8, seed: int = 0) -> BlockResults:
    """seqs: prompt + continuation; starts[i]: first anchor (the last prompt token's position)."""
    from adaspec.sample.probs import processed_probs
    from adaspec.train.drafter_loss import block_forward

    device = next(drafter.parameters()).device
    K = drafter.block_size
    k = k or K
    gen = torch.Generator().manual_seed(seed)
    rows_c, rows_a, rows_s = [], [], []
    for i in range(0, len(seqs), batch_size):
        batch = seqs[i:i + batch_size]
        ids, anc, ok = teacher_forced_batch(batch, starts[i:i + batch_size], K)
        if anc.shape[1] == 0:
            continue
        anchors = ok.sum(1).tolist()  # each row's real anchors
        with _autocast(device):
            bb = block_forward(target, drafter, ids.to(device), anc.to(device))
        lg, tl = bb.logits[..., :k, :][ok.to(device)], bb.target_logits[..., :k, :][ok.to(device)]  # [n, k, V]
        n, V = lg.shape[0], lg.shape[-1]
        if temperature <= 0:
            alpha = (lg.argmax(-1) == tl.argmax(-1)).float()
        else:
            temp = torch.full((n * k,), float(temperature), device=device)
            ones, zeros = torch.ones_like(temp), torch.zeros(n * k, dtype=torch.long, device=device)
            q = processed_probs(lg.reshape(-1, V), temp, ones, zeros, any_filter=False, any_greedy=False)
            p = processed_probs(tl.reshape(-1, V), temp, ones, zeros, any_filter=False, any_greedy=False)
            alpha = torch.minimum(p, q).sum(-1).clamp(0, 1).reshape(n, k)
        rows_c.append(bb.conf_logits[..., :k][ok.to(device)].float().cpu().numpy())
        rows_a.append(alpha.cpu().numpy())
        rows_s.append(np.repeat(np.arange(i, i + len(batch)), anchors))  # ok's row-major order
    conf = np.concatenate(rows_c) if rows_c else np.zeros((0, k))
    alpha = np.concatenate(rows_a) if rows_a else np.zeros((0, k))
    seq = np.concatenate(rows_s) if rows_s else np.zeros(0, dtype=np.int64)
    return BlockResults(conf, alpha, sample_accepted(alpha, gen), temperature, seq)


def sample_accepted(alpha: np.ndarray, gen: torch.Generator) -> np.ndarray:
    """Accepted length: leading slots whose uniform draw falls under alpha (exact when alpha is 0/1)."""
    u = torch.rand(alpha.shape, generator=gen, dtype=torch.float64).numpy()
    acc = (u < alpha).astype(np.int64)
    return np.cumprod(acc, axis=1).sum(1)


def _autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def summarize(res: BlockResults, temps=None) -> dict:
    """Per-slot acceptance, tau and confidence quality (survival vs prefix acceptance)."""
    from adaspec.spec_decode.calibration import auc, ece, per_slot_metrics, prefix_labels, survival_from_logits

    N, k = res.alpha.shape
    surv_exp = np.cumprod(res.alpha, axis=1).mean(0)  # expected P(slots 1..j accepted)
    cond = [float(surv_exp[0])] + [float(surv_exp[j] / surv_exp[j - 1]) if surv_exp[j - 1] > 0 else 0.0
                                   for j in range(1, k)]
    counts = [(res.accepted >= j).sum() for j in range(k + 1)]
    cond_sampled = [float(counts[j] / counts[j - 1]) if counts[j - 1] else 0.0 for j in range(1, k + 1)]
    raw = survival_from_logits(res.conf_logits)
    labels, _ = prefix_labels(res.accepted, k)
    # the blocks decoding's walk reaches (walk_blocks): the confidences an engine really meets, whose
    # ECE can differ from every anchor's (at T = 0 it was 0.020 against 0.048, H100 run 59)
    walk = walk_blocks(res.accepted, res.seq) if res.seq is not None and N else None

    def ece_walk(surv):
        return ece(surv[walk], labels[walk]) if walk is not None else None

    out = {
        "temperature": res.temperature, "blocks": int(N), "k": int(k),
        "tau": float(1.0 + surv_exp.sum()),  # bonus token included
        "tau_sampled": float(1.0 + res.accepted.mean()) if N else float("nan"),
        # decoding's own walk over the same blocks (walk_tau): the tokens per step an engine can realize
        "tau_walk": walk_tau(res.accepted, res.seq) if res.seq is not None and N else None,
        "cond_acceptance": cond,
        "cond_acceptance_sampled": cond_sampled,
        "survival": surv_exp.tolist(),
        "confidence_raw": {"per_slot": per_slot_metrics(raw, res.accepted), "ece": ece(raw, labels),
                           "ece_walk": ece_walk(raw), "auc": auc(raw, labels)},
    }
    if temps is not None:
        cal = survival_from_logits(res.conf_logits, temps)
        out["confidence_calibrated"] = {"per_slot": per_slot_metrics(cal, res.accepted), "ece": ece(cal, labels),
                                        "ece_walk": ece_walk(cal), "auc": auc(cal, labels),
                                        "temperatures": [float(t) for t in temps]}
    return out


def save_blocks(path, runs: list[tuple[BlockResults, list | None]]) -> None:
    """Every block the walk reaches, per temperature, for replays of the adaptive policy over real
    per-request confidences (benchmarks/replay_policy.py --blocks): `T{t}_conf` [N, k] float16 the
    confidences the engine would see (the calibration temperatures applied, as propose() does),
    `T{t}_accepted` [N] uint8 the accepted drafts, `T{t}_alpha` [N, k] float16 each slot's acceptance
    probability given the block's prefix (the accepted drafts were drawn from it; 0 / 1 at T = 0):
    what a confidence head that knew it exactly would say. Small: the walk reaches one block in
    tau_walk, so a build's 250 prompts x 128 tokens give ~9-11k blocks per temperature, ~30 bytes each."""
    from adaspec.spec_decode.policy import apply_temperature

    arrays = {}
    for res, temps in runs:
        idx = walk_blocks(res.accepted, res.seq) if res.seq is not None else np.arange(len(res.accepted))
        key = "T%g" % res.temperature
        arrays[f"{key}_conf"] = np.asarray(apply_temperature(res.conf_logits[idx], temps), dtype=np.float16)
        arrays[f"{key}_accepted"] = np.asarray(res.accepted[idx], dtype=np.uint8)
        arrays[f"{key}_alpha"] = np.asarray(res.alpha[idx], dtype=np.float16)
    np.savez_compressed(path, **arrays)


def format_table(s: dict) -> str:
    k = s["k"]
    walk = f"; decoding walk {s['tau_walk']:.3f}" if s.get("tau_walk") is not None else ""
    lines = [f"T={s['temperature']:g}  blocks={s['blocks']}  tau={s['tau']:.3f} (bonus included; sampled "
             f"{s['tau_sampled']:.3f}{walk})",
             "slot  cond.acc  survival  ECE(raw)  AUC(raw)" + ("  ECE(cal)" if "confidence_calibrated" in s else "")]
    for j in range(k):
        r = s["confidence_raw"]["per_slot"][j]
        line = f"{j + 1:>4}  {s['cond_acceptance'][j]:8.3f}  {s['survival'][j]:8.3f}  {r['ece']:8.4f}  {r['auc']:8.3f}"
        if "confidence_calibrated" in s:
            line += f"  {s['confidence_calibrated']['per_slot'][j]['ece']:8.4f}"
        lines.append(line)
    lines.append(f"all   ECE(raw) {s['confidence_raw']['ece']:.4f}  AUC(raw) {s['confidence_raw']['auc']:.3f}"
                 + (f"  ECE(cal) {s['confidence_calibrated']['ece']:.4f}" if "confidence_calibrated" in s else ""))
    used = s.get("confidence_calibrated") or s["confidence_raw"]
    if used.get("ece_walk") is not None:
        lines.append(f"walk  ECE({'cal' if 'confidence_calibrated' in s else 'raw'}) {used['ece_walk']:.4f} over the "
                     "blocks decoding's walk reaches")
    return "\n".join(lines)


def generate_eval_set(target, prompts: list[list[int]], gen_len: int, temperature: float, seed: int = 0,
                      batch_size: int = 256):
    """-> (sequences, first-anchor positions): target continuations of the prompts."""
    from adaspec.train.self_distill import sample_ragged

    seqs = sample_ragged(target, prompts, gen_len, temperature, seed=seed, batch_size=batch_size)
    return seqs, [len(p) - 1 for p in prompts]
