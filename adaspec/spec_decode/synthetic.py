"""`"method": "synthetic"`: speculative decoding with a configured acceptance curve, for timing
studies of shapes that have no trained drafter (e.g. Qwen3-8B with load_format "dummy").

What is real and what is not:
- the target runs for real (the verify forward of every drafted block, at the length the policy
  chose);
- the drafter is a real DSpark drafter (the same propose and write_context code) on random
  weights, so a step pays what a trained drafter of that shape would pay;
- acceptance is NOT the target's judgement: draft j of a block is accepted with the configured
  probability ``curve[j]`` given that drafts < j were accepted (a keyed uniform, so a run is
  reproducible), truncated at the verify length; the step then emits the accepted drafts and the
  target's own token (greedy or sampled from p, no residual) at the first rejected or bonus slot;
- the confidences the adaptive policy sees are ``curve[j]`` plus Gaussian noise (std
  ``synthetic_confidence_noise``), clipped to [0, 1]: a calibrated drafter with some scatter.
The output text is therefore not the target's distribution: every statistic, metric and report
of such a run carries LABEL.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

import torch

from adaspec.errors import ConfigError
from adaspec.models.drafter import DrafterConfig, DSparkDrafter, load_drafter_config
from adaspec.sample.random import ACCEPT, SAMPLE, keyed_uniforms, sample_categorical
from adaspec.sample.rejection import RejectionOutput

log = logging.getLogger("adaspec.spec")

LABEL = "synthetic acceptance: timing only"
# keyed-uniform streams of the confidence noise (two uniforms per slot, Box-Muller); apart from
# SAMPLE, ACCEPT and DRAFT (sample/random.py), so the noise is independent of the accept draws
NOISE_STREAMS = (101, 102)
DRAFTER_KEYS = {"num_layers": 1, "markov_rank": 64, "block_size": None, "mask_token_id": 1}


# ---- config ------------------------------------------------------------------------------
def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_config(c) -> None:
    """ConfigError naming the key for a bad synthetic setting (SpeculativeConfig.from_dict calls it)."""
    curve = c.synthetic_acceptance
    if curve is None:
        raise ConfigError("\"method\": \"synthetic\" needs \"synthetic_acceptance\": the conditional acceptance "
                          "probability of each draft position, e.g. [0.62, 0.56, 0.55, 0.54, 0.62, 0.68, 0.72]")
    if not isinstance(curve, (list, tuple)) or not curve:
        raise ConfigError(f"synthetic_acceptance must be a non-empty list of probabilities, got {curve!r}")
    bad = [(j, x) for j, x in enumerate(curve) if not (_number(x) and 0.0 <= x <= 1.0)]
    if bad:
        raise ConfigError(f"synthetic_acceptance must hold numbers in [0, 1]; position {bad[0][0]} is {bad[0][1]!r}")
    k = c.num_speculative_tokens
    if k is not None and len(curve) < k:
        raise ConfigError(f"synthetic_acceptance has {len(curve)} values but num_speculative_tokens is {k}: "
                          "give one per draft position")
    noise = c.synthetic_confidence_noise
    if not (_number(noise) and noise >= 0):
        raise ConfigError(f"synthetic_confidence_noise must be a number >= 0, got {noise!r}")
    shape = c.synthetic_drafter
    if shape is None:
        return
    if c.model is not None:
        raise ConfigError("give either \"model\" (its config.json is the stand-in drafter's shape) or "
                          "\"synthetic_drafter\", not both")
    if not isinstance(shape, dict):
        raise ConfigError(f"synthetic_drafter must be a JSON object, got {shape!r}")
    unknown = sorted(set(shape) - set(DRAFTER_KEYS))
    if unknown:
        raise ConfigError(f"unknown synthetic_drafter key(s): {', '.join(unknown)}; known: {', '.join(DRAFTER_KEYS)}")
    for key, v in shape.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "mask_token_id" else 1):
            raise ConfigError(f"synthetic_drafter.{key} must be a positive integer, got {v!r}")
    bs = shape.get("block_size")
    if bs is not None and k is not None and bs < k:
        raise ConfigError(f"synthetic_drafter.block_size={bs} is below num_speculative_tokens={k}")


# ---- the pure pieces ---------------------------------------------------------------------
def accepted_prefix(curve: torch.Tensor, num_verify: torch.Tensor, seeds: torch.Tensor,
                    anchor_positions: torch.Tensor) -> torch.Tensor:
    """[N] accepted drafts: slot j passes iff U(seed, anchor+1+j, ACCEPT, anchor) < curve[j], and the
    prefix stops at the first failure or at num_verify. So P(j accepted | j-1 accepted) = curve[j]."""
    K = curve.shape[0]
    dev = curve.device
    anchors = anchor_positions.to(dev).long()
    pos = torch.arange(K, device=dev)
    u = keyed_uniforms(seeds.to(dev), anchors[:, None] + 1 + pos[None, :], ACCEPT, anchors[:, None])
    ok = (u < curve[None, :].float()) & (pos[None, :] < num_verify.to(dev).long()[:, None])
    return ok.long().cumprod(dim=1).sum(dim=1)


def synthetic_accept(curve: torch.Tensor, draft_tokens: torch.Tensor, num_verify: torch.Tensor,
                     target_probs: torch.Tensor, is_greedy: torch.Tensor, seeds: torch.Tensor,
                     anchor_positions: torch.Tensor, target_argmax: torch.Tensor | None = None) -> RejectionOutput:
    """rejection_sample's contract (sample/rejection.py) with acceptance drawn from `curve` [>= K]:
    the accepted drafts, then the target's own token at the stop slot (argmax for greedy rows, a
    draw from p with the SAMPLE key otherwise)."""
    N, K = draft_tokens.shape
    dev = target_probs.device
    anchors = anchor_positions.to(dev).long()
    seeds = seeds.to(dev)
    n_acc = accepted_prefix(curve.to(dev)[:K], num_verify.to(dev).long().clamp(0, K), seeds, anchors)
    if target_argmax is None:
        target_argmax = target_probs.argmax(dim=-1)
    greedy_tok = target_argmax.to(dev).long().gather(1, n_acc.view(N, 1)).squeeze(1)
    p_stop = target_probs.gather(1, n_acc.view(N, 1, 1).expand(N, 1, target_probs.shape[-1])).squeeze(1)
    sampled = sample_categorical(p_stop, keyed_uniforms(seeds, anchors + 1 + n_acc, SAMPLE))
    final = torch.where(is_greedy.to(dev).bool(), greedy_tok, sampled)
    out_pos = torch.arange(K + 1, device=dev)
    drafts = torch.cat([draft_tokens.to(dev).long(), torch.full((N, 1), -1, dtype=torch.long, device=dev)], dim=1)
    out = torch.where(out_pos[None, :] < n_acc[:, None], drafts, torch.full_like(drafts, -1))
    out = torch.where(out_pos[None, :] == n_acc[:, None], final[:, None], out)
    return RejectionOutput(out, n_acc, n_acc + 1)


def synthetic_confidences(curve: torch.Tensor, noise_std: float, seeds: torch.Tensor,
                          anchor_positions: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] curve[j] + N(0, noise_std) per slot (keyed by seed, position and anchor), clipped to [0, 1]."""
    dev = curve.device
    anchors = anchor_positions.to(dev).long()[:, None]
    pos = anchors + 1 + torch.arange(k, device=dev)[None, :]
    seeds = seeds.to(dev)
    u1 = keyed_uniforms(seeds, pos, NOISE_STREAMS[0], anchors)
    u2 = keyed_uniforms(seeds, pos, NOISE_STREAMS[1], anchors)
    z = torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2)  # 1 - u1 in (0, 1]
    return (curve[None, :k].float() + noise_std * z).clamp(0.0, 1.0)


# ---- the stand-in drafter ----------------------------------------------------------------
class SyntheticDrafter(DSparkDrafter):
    """A DSpark drafter (random weights) whose confidences are the curve plus noise, and whose
    accept() replaces rejection sampling (same arguments)."""

    label = LABEL

    def __init__(self, cfg: DrafterConfig, curve: list[float], noise_std: float):
        super().__init__(cfg)
        # a plain attribute, not a buffer: .to(dtype) must not round the probabilities to bf16
        self.acceptance_curve = torch.tensor(curve, dtype=torch.float32)
        self.confidence_noise = float(noise_std)

    def draft_block(self, h, anchor_ids, anchor_pos, sampling, return_logits: bool = False, width: int | None = None,
                    probs_out: torch.Tensor | None = None, draft_bias: torch.Tensor | None = None):
        """The real drafter's work (its cost), then the synthetic confidences (the eager propose
        and the graphed step both draft through here)."""
        prop = super().draft_block(h, anchor_ids, anchor_pos, sampling, return_logits, width, probs_out,
                                   draft_bias=draft_bias)
        conf = synthetic_confidences(self.acceptance_curve, self.confidence_noise, sampling.seeds, anchor_pos,
                                     prop.tokens.shape[1])
        return replace(prop, confidences=conf.to(prop.confidences.device))

    def accept(self, draft_tokens, num_verify, target_probs, draft_probs, is_greedy, seeds, anchor_positions,
               target_argmax=None) -> RejectionOutput:
        del draft_probs  # acceptance does not look at q
        return synthetic_accept(self.acceptance_curve, draft_tokens, num_verify, target_probs, is_greedy, seeds,
                                anchor_positions, target_argmax)


def synthetic_drafter_config(spec_cfg, target_cfg) -> DrafterConfig:
    """The stand-in's shape: `model`'s config.json when given, else one built from the target's
    config (synthetic_drafter keys; block_size defaults to k, or to the curve's length)."""
    if spec_cfg.model is not None:
        dcfg, _ = load_drafter_config(spec_cfg.model)
        dcfg.check_target(target_cfg)
        return dcfg
    shape = {**DRAFTER_KEYS, **(spec_cfg.synthetic_drafter or {})}
    block = shape["block_size"] or spec_cfg.num_speculative_tokens or len(spec_cfg.synthetic_acceptance)
    mask = shape["mask_token_id"]
    if not 0 <= mask < target_cfg.vocab_size:
        raise ConfigError(f"synthetic_drafter.mask_token_id={mask} is outside the target's vocabulary")
    return DrafterConfig.from_target(target_cfg, mask_token_id=mask, block_size=block, num_layers=shape["num_layers"],
                                     markov_rank=shape["markov_rank"])


def load_synthetic_drafter(spec_cfg, engine) -> tuple[SyntheticDrafter, DrafterConfig, str]:
    """-> (drafter with dummy weights on the engine's device and dtype, its config, a name for the
    cost-model cache key that says what was timed)."""
    from adaspec.models.loader import init_dummy_weights

    dcfg = synthetic_drafter_config(spec_cfg, engine.model_config)
    k = spec_cfg.num_speculative_tokens or dcfg.block_size
    if len(spec_cfg.synthetic_acceptance) < k:
        raise ConfigError(f"synthetic_acceptance has {len(spec_cfg.synthetic_acceptance)} values but the drafter "
                          f"drafts k={k}: give one per draft position")
    # one value per slot of the drafter's block: slots past k are never verified (0 keeps their
    # confidences, which the policy never reads past k either, well defined)
    curve = list(spec_cfg.synthetic_acceptance[:dcfg.block_size])
    curve += [0.0] * (dcfg.block_size - len(curve))
    with torch.device("meta"):
        drafter = SyntheticDrafter(dcfg, curve, spec_cfg.synthetic_confidence_noise)
    drafter = drafter.to(dtype=engine.dtype).to_empty(device=engine.device)
    init_dummy_weights(drafter, seed=1)
    drafter.acceptance_curve = torch.tensor(curve, dtype=torch.float32, device=engine.device)
    drafter.rope.build_tables(device=engine.device)
    drafter.eval()
    log.warning("speculative method \"synthetic\" (%s): a %d-layer DSpark drafter on random weights, acceptance per "
                "position drawn from %s; the output is not the target's distribution", LABEL, dcfg.num_layers,
                spec_cfg.synthetic_acceptance[:k])
    shape = {"layers": dcfg.num_layers, "block_size": dcfg.block_size, "markov_rank": dcfg.markov_rank,
             "target_layer_ids": dcfg.target_layer_ids, "model": spec_cfg.model}
    return drafter, dcfg, "synthetic:" + json.dumps(shape, sort_keys=True)
