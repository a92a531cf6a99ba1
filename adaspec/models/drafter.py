"""The DSpark drafter (DSPARK.md): a block of k drafts from one backbone pass, a Markov head
refining them left to right, and a confidence per draft.

Parameter names are exactly DeepSpec's (no prefix), so a public DSpark checkpoint loads.

Two forwards share the layers:

- ``forward_train(input_ids [B,T], features [B,T,m*d], anchors [B,A])``: many blocks per
  sequence in ONE batched pass (dense boolean mask + SDPA). Block b's queries see the
  block's own keys (bidirectional) and every context token strictly before its anchor;
  blocks never see each other. Returns the final-normed hidden states [B, A, k, d].
- the engine path below, over the drafter's own paged KV cache.

Inference API (what the engine calls each speculative step)
-----------------------------------------------------------
``kv_cache_spec() -> (num_layers, num_kv_heads, head_dim)``
    The engine allocates one ``(k_cache, v_cache)`` pair per drafter layer, each
    ``[num_slots, num_kv_heads, head_dim]``, with the SAME num_blocks / block_size as the
    target's cache, and addresses it with the SAME block tables. So sequence position p has
    the same slot in both caches, and rolling back is free: the engine forgets positions,
    and whatever stale K/V sits in their slots is overwritten before it is ever read again
    (every read is limited to positions the engine has (re)written).

``write_context(features [T, m*d], positions [T], slot_mapping [T], kv_caches)``
    For newly verified tokens: ``H_ctx = hidden_norm(fc(features))`` (``features`` = the
    target's hidden states of ``target_layer_ids``, concatenated in that order), then every
    layer's context K/V = its own k_proj/v_proj of the SAME H_ctx (+ k_norm, + RoPE at the
    token's position), written to ``slot_mapping``.

``propose(anchor_ids [R], anchor_pos [R], block_tables, block_size, kv_caches,
sampling: SamplingBatch) -> DraftProposal``
    Context of request r = all positions < anchor_pos[r] (already written by
    write_context). One backbone pass for all R blocks: the block's own K/V is written
    TEMPORARILY into the slots of positions anchor_pos..anchor_pos+k-1 (the engine keeps
    those allocated; real context overwrites them later), every block query sees keys
    [0, anchor_pos + k). Then the Markov loop, left to right: greedy rows take the argmax,
    sampled rows draw from ``processed_probs`` with the keyed uniform DRAFT(seed, position,
    anchor) (sample/random.py). Returns
    tokens [R,k], probs [R,k,V] (the processed q_j each draft was drawn from: rejection
    sampling must use exactly these), logits [R,k,V] (raw U_j + B(x_{j-1}); with return_logits only), confidences
    [R,k] (calibrated when the config holds temperatures: the greedy set for rows with
    temperature 0 when there is one) and conf_logits [R,k] (raw).
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.cuda_compiled import cuda_compiled
from adaspec.models.attention import build_attention_metadata, paged_attention
from adaspec.models.config import ModelConfig
from adaspec.models.drafter_config import (  # noqa: F401  (re-exported: one import for users)
    ARCHITECTURE, OUR_KEY, DrafterConfig, default_target_layers, with_temperatures,
)
from adaspec.models.layers import RMSNorm, RotaryEmbedding, embedding
from adaspec.models.target import DecoderLayer
from adaspec.sample.batch import SamplingBatch
from adaspec.sample.random import DRAFT, keyed_uniforms_eager

@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [R, k] long
    probs: torch.Tensor  # [R, k, V] processed q_j (what rejection sampling must use)
    logits: torch.Tensor | None  # [R, k, V] raw draft logits U_j + B(x_{j-1}), float32 (return_logits only)
    confidences: torch.Tensor  # [R, k] c_j (calibrated if temperatures are set)
    conf_logits: torch.Tensor  # [R, k] raw confidence logits


class MarkovHead(nn.Module):
    """Low-rank bigram bias B(prev, .) = W2 W1[prev]."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        b = cfg.base
        self.config = cfg
        d, V, m = b.hidden_size, b.vocab_size, len(cfg.target_layer_ids)
        self.embed_tokens = embedding(V, d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.fc = nn.Linear(m * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, b.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(b) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, b.rms_norm_eps)
        self.markov_head = MarkovHead(V, cfg.markov_rank)
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(d + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))
        else:
            self.confidence_head = None
        # the engine sets "triton" on CUDA (its kernel does the block's bidirectional mask);
        # "varlen" is causal-only, so the drafter never uses it
        self.attention_backend = "reference"
        self.rope = RotaryEmbedding.from_config(b)
        self.freeze_target_parts()

    def freeze_target_parts(self) -> None:
        """Embedding and LM head are the target's and stay frozen."""
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    @torch.no_grad()
    def copy_from_target(self, target) -> None:
        self.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        self.lm_head.weight.copy_(target.lm_head.weight)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ---- pieces shared by both paths -------------------------------------------------
    def context_states(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def _context_kv(self, attn, h_ctx: torch.Tensor, positions: torch.Tensor):
        """A layer's K/V of context states for the training pass: k_proj/v_proj (+ k_norm, + RoPE),
        no input norm (the engine's write_context: Attention.kv_written, the same ops or one kernel)."""
        k, v = attn.kv_projections(h_ctx)
        return attn.k_normed_rotated(k, positions, self.rope), v

    def block_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[...] anchor ids -> [..., k, d]: the embedded anchor, then k-1 mask embeddings."""
        return self.embed_tokens(block_token_ids(anchor_ids, self.block_size, self.config.mask_token_id))

    def heads(self, h: torch.Tensor, prev: torch.Tensor, base_logits: torch.Tensor | None = None):
        """h [..., d] final-normed, prev [...] previous token -> (draft logits U + B [..., V] float32,
        confidence logits [...] float32). base_logits: U = lm_head(h) when already computed."""
        base = self.lm_head(h).float() if base_logits is None else base_logits
        return self.markov_logits(base, prev), self.confidence_logits(h, prev)

    def markov_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """U + B(prev): base U [..., V] float32, prev [...] -> [..., V] float32. The bias is added
        in its own dtype: the sum is float32 by promotion, one kernel (an explicit .float() of
        the bias first was a second one, the same values)."""
        return base + self.markov_head.markov_w2(self.markov_head.markov_w1(prev))

    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [..., d] final-normed, prev [...] the previous tokens -> [...] float32."""
        if self.confidence_head is None:
            return torch.full(prev.shape, 20.0, device=h.device)  # no head: always confident
        return confidence_logits(h, prev, *self._confidence_weights())

    def _confidence_weights(self):
        """(the Markov head's W1 when the confidence head reads it, else None; the head's weight, bias)."""
        w1 = self.markov_head.markov_w1.weight if self.config.confidence_head_with_markov else None
        return w1, self.confidence_head.proj.weight, self.confidence_head.proj.bias

    def confidences(self, conf_logits: torch.Tensor, greedy: torch.Tensor | None = None) -> torch.Tensor:
        """sigmoid(logit_j / T_j); rows flagged in `greedy` [R] use the greedy set when there is one."""
        temps, temps_greedy = self._confidence_temperatures(conf_logits.device)
        return calibrated(conf_logits, temps, temps_greedy, greedy)

    def _confidence_temperatures(self, dev):
        """The calibration temperatures on `dev`, copied once (a CUDA graph must not read a host
        buffer that is freed after capture)."""
        t, tg = self.config.confidence_temperatures, self.config.confidence_temperatures_greedy
        key = (str(dev), None if t is None else tuple(t), None if tg is None else tuple(tg))
        cached = getattr(self, "_conf_temps_cache", None)
        if cached is None or cached[0] != key:
            temps = torch.tensor(t, dtype=torch.float32, device=dev) if t is not None else \
                torch.ones(self.block_size, device=dev)
            greedy = torch.tensor(tg, dtype=torch.float32, device=dev) if tg is not None else None
            self._conf_temps_cache = cached = (key, temps, greedy)
        return cached[1], cached[2]

    # ---- training path ---------------------------------------------------------------
    def forward_train(self, input_ids: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """input_ids [B,T], features [B,T,m*d], anchors [B,A] (0 <= a, a+k-1 < max positions)
        -> final-normed hidden [B, A, k, d]. Slot j of anchor a sits at position a+j."""
        B, T = input_ids.shape
        A, k = anchors.shape[1], self.block_size
        h_ctx = self.context_states(features)
        ctx_pos = torch.arange(T, device=input_ids.device).expand(B, T)
        blk_pos = (anchors.unsqueeze(-1) + torch.arange(k, device=anchors.device)).reshape(B, A * k)
        x = self.block_inputs(input_ids.gather(1, anchors)).reshape(B, A * k, -1)
        mask = block_attention_mask(anchors, T, k)
        for layer in self.layers:
            attn = layer.self_attn
            q, kb, vb = attn.qkv(layer.input_layernorm(x), blk_pos, self.rope)
            kc, vc = self._context_kv(attn, h_ctx, ctx_pos)
            keys, values = torch.cat([kc, kb.to(kc.dtype)], 1), torch.cat([vc, vb.to(vc.dtype)], 1)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
                attn_mask=mask, scale=attn.scale, enable_gqa=True,
            ).transpose(1, 2)
            x = x + attn.o_proj(out.reshape(B, A * k, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).reshape(B, A, k, -1)

    # ---- engine path -----------------------------------------------------------------
    def kv_cache_spec(self) -> tuple[int, int, int]:
        b = self.config.base
        return self.config.num_layers, self.layers[0].self_attn.num_kv_heads, b.head_dim  # this rank's heads under TP

    @torch.no_grad()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if features.shape[0] == 0:
            return
        h_ctx = self.context_states(features.to(self.fc.weight.dtype))
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            layer.self_attn.kv_written(h_ctx, positions, self.rope, k_cache, v_cache, slot_mapping)

    @torch.no_grad()
    def backbone_step(self, anchor_ids, anchor_pos, block_tables, block_size, kv_caches,
                      anchor_pos_host: list[int] | None = None) -> torch.Tensor:
        """One pass for R blocks over the paged cache -> final-normed hidden [R, k, d].
        anchor_pos_host: the positions as host ints (saves reading anchor_pos back from the GPU)."""
        R, k = anchor_ids.shape[0], self.block_size
        pos_list = [int(p) for p in (anchor_pos.tolist() if anchor_pos_host is None else anchor_pos_host)]
        ends = [p + k for p in pos_list]
        meta = build_attention_metadata(
            self.attention_backend, block_tables, [k] * R, ends, [[e] * k for e in ends], block_size, anchor_ids.device
        )
        return self.backbone_forward(anchor_ids, anchor_pos, meta, kv_caches)

    def backbone_forward(self, anchor_ids, anchor_pos, meta, kv_caches, positions=None) -> torch.Tensor:
        """The backbone pass over given attention metadata (the block's slots in meta.slot_mapping,
        every block query seeing keys [0, anchor_pos + k)); no host work, so a CUDA graph can hold it.
        positions: the block positions flat [R * k] (anchor_pos + 0..k-1) when the caller has them."""
        R, k = anchor_ids.shape[0], self.block_size
        if positions is None:
            positions = (anchor_pos.unsqueeze(-1) + torch.arange(k, device=anchor_pos.device)).reshape(-1)
        x = self.block_inputs(anchor_ids).reshape(R * k, -1)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            attn = layer.self_attn
            # the block's keys and values are temporary: the real context overwrites them
            q = attn.q_with_kv_written(layer.input_layernorm(x), positions, self.rope, k_cache, v_cache,
                                       meta.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, meta, attn.scale)
            x = x + attn.o_proj(out.reshape(R * k, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).reshape(R, k, -1)

    @torch.no_grad()
    def propose(self, anchor_ids, anchor_pos, block_tables, block_size, kv_caches,
                sampling: SamplingBatch, anchor_pos_host: list[int] | None = None,
                return_logits: bool = False, width: int | None = None,
                draft_bias: torch.Tensor | None = None) -> DraftProposal:
        """return_logits: also stack the raw draft logits [R, k, V] (tests compare them with the
        training forward; the engine never reads them, and at a 150k vocabulary they are ~0.6 MB
        per draft slot). width: draft the first `width` slots only (see draft_block). draft_bias:
        see draft_block."""
        if anchor_ids.shape[0] == 0:
            V, k = self.config.base.vocab_size, self.block_size
            z = torch.zeros(0, k, device=anchor_ids.device)
            return DraftProposal(z.long(), torch.zeros(0, k, V, device=z.device), torch.zeros(0, k, V, device=z.device), z, z)
        h = self.backbone_step(anchor_ids, anchor_pos, block_tables, block_size, kv_caches, anchor_pos_host)
        return self.draft_block(h, anchor_ids, anchor_pos, sampling, return_logits, width, draft_bias=draft_bias)

    def draft_block(self, h, anchor_ids, anchor_pos, sampling, return_logits: bool = False,
                    width: int | None = None, probs_out: torch.Tensor | None = None,
                    draft_bias: torch.Tensor | None = None) -> DraftProposal:
        """The Markov loop and the confidences over backbone states h [R, k, d]; device work only.
        sampling: a SamplingBatch (or anything with its temperature, seeds, all_greedy, draw).
        width: the heads run for the first `width` slots only (an engine verifying at most k <
        block_size drafts): slot j's draft and confidence depend on h[:, j] and the drafts before
        it, never on later slots, so they are the full block's, for none of the later slots'
        vocabulary projections and Markov steps (the backbone still runs on the whole block,
        whose positions attend to each other).
        probs_out: optional float32 [R, width, V] (rows contiguous) that receives the sampled
        slots' draft distributions q (the graphed step's static buffer: no stack, no copy).
        draft_bias: optional float32 [R, V] added to every slot's draft logits (requests' logits
        rules, as far as they are additive at the anchor: sample/logits_rules.draft_bias), or
        [R, 2, V]: the first slot's (with structured outputs' mask) and the other slots'; q is the
        distribution drawn from, so verification stays exact whatever the bias."""
        if width is not None:
            # contiguous: given the strided view [R, width, d] of a wider block, F.linear runs the LM
            # head as a batched matmul that reads its whole weight once per request (H100 run 70: a
            # 2-slot draft of the Qwen3-8B shape took 107 ms at 256 requests, the 7-slot one 5 ms)
            h = h[:, :width].contiguous()
        R, w = h.shape[0], h.shape[1]
        all_greedy = sampling.all_greedy
        anchors = anchor_pos.long()
        fused = self._fused_markov(h, sampling)
        # U_j of every slot in ONE matmul: it does not depend on x_{j-1} (the fused kernels read it
        # in bf16 and widen it themselves: the same float32 values, one kernel less)
        base = self.lm_head(h)
        V = base.shape[-1]
        q = u = None
        if not all_greedy:  # greedy rows get a one-hot q, so the draw returns their argmax
            q = probs_out if probs_out is not None else torch.empty(R, w, V, dtype=torch.float32, device=h.device)
            u = draft_uniforms(sampling.seeds, anchors, w)
        tokens = None
        if fused is not None:
            tokens, logits = self._markov_loop_fused_or_none(fused, base, anchor_ids, sampling, q, u, draft_bias,
                                                             return_logits)
        if tokens is None:
            tokens, logits = self._markov_loop(base.float(), anchor_ids, sampling, q, u, draft_bias, return_logits)
        # all rows greedy: q is the one-hot of the argmax, built once instead of per slot
        # (scatter, not F.one_hot: one_hot checks its input on the host, a sync a graph cannot hold)
        if q is None:
            q = torch.zeros(R, w, V, dtype=torch.float32, device=h.device).scatter_(-1, tokens.unsqueeze(-1), 1.0)
        # the confidences of every slot at once, after the loop: slot j's reads h_j and x_{j-1} only
        # (per slot, inside the loop, they were 3-4 small kernels each)
        if self.confidence_head is None:
            conf_logits = self.confidence_logits(h, torch.cat([anchor_ids[:, None], tokens[:, :-1]], dim=1))
            conf = self.confidences(conf_logits, sampling.temperature <= 0)
        else:  # one compiled function on CUDA (~10 small kernels as torch ops)
            conf, conf_logits = slot_confidences(h, anchor_ids, tokens, *self._confidence_weights(),
                                                 *self._confidence_temperatures(h.device), sampling.temperature)
        return DraftProposal(tokens, q, logits, conf, conf_logits)

    def _markov_loop(self, base, anchor_ids, sampling, q, u, draft_bias, return_logits: bool):
        """The Markov loop as torch ops over base [R, w, V] float32 -> (tokens [R, w], logits [R, w, V] or None)."""
        toks, logits = [], []
        prev = anchor_ids
        for j in range(base.shape[1]):  # k small rank-r matmuls: the semi-autoregressive part
            lg = self.markov_logits(base[:, j], prev)
            if draft_bias is not None:  # [R, V] for every slot, or [R, 2, V]: the first slot's, the others'
                lg = lg + _slot_bias(draft_bias, j)
            if q is None:
                tok = lg.argmax(-1)
            else:
                tok, _ = sampling.draw(lg, u[j], out=q[:, j])
            toks.append(tok)
            if return_logits:
                logits.append(lg)
            prev = tok
        return torch.stack(toks, 1), (torch.stack(logits, 1) if return_logits else None)

    def _fused_markov(self, h, sampling):
        """The fused Markov kernels' module (models/markov_triton.py) when they can run this loop:
        CUDA, triton importable, switched on, no top-k / top-p rows (`any_filter`; a sampling
        object that does not say runs the torch loop), no gradient wanted, the head's two weights
        of one dtype and a rank the kernels take; else None."""
        if not h.is_cuda or getattr(sampling, "any_filter", True):
            return None
        w1, w2 = self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight
        if torch.is_grad_enabled() and (h.requires_grad or w1.requires_grad or w2.requires_grad):
            return None
        from adaspec.sample import kernels
        if w1.dtype != w2.dtype or not kernels.use_triton(h):
            return None
        from adaspec.models import markov_triton
        return markov_triton if markov_triton.enabled() and w2.shape[1] <= markov_triton.MAX_RANK else None

    def _markov_loop_fused_or_none(self, mt, base, anchor_ids, sampling, q, u, draft_bias, return_logits: bool):
        """_markov_loop_fused; (None, None) when a variant of its kernels fails the first time it runs
        in this process (markov_triton.FusedKernelUnavailable: a Triton that cannot compile it, say):
        the kernels are then switched off with a warning and the caller drafts with the torch loop.
        (The graphed step runs every graph once before it captures it, so a first run is eager.)"""
        try:
            return self._markov_loop_fused(mt, base, anchor_ids, sampling, q, u, draft_bias, return_logits)
        except mt.FusedKernelUnavailable as e:
            mt.set_enabled(False)
            warnings.warn(f"the drafter's fused Markov kernels failed ({e}); drafting with the torch loop from now on",
                          RuntimeWarning, stacklevel=3)
            return None, None

    def _markov_loop_fused(self, mt, base, anchor_ids, sampling, q, u, draft_bias, return_logits: bool):
        """The Markov loop in the fused kernels over base [R, w, V] (bf16 or float32) -> (tokens
        [R, w], logits [R, w, V] float32 or None): few rows of a small vocabulary in one kernel a slot
        (plus one; markov_loop_triton.serves says which), else markov_triton's two a slot for
        greedy drafts, three for sampled."""
        R, w, V = base.shape
        tokens = torch.empty(R, w, dtype=torch.long, device=base.device)
        w1, w2 = self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight
        from adaspec.models import markov_loop_triton as ml

        if ml.serves(R, V, markov_loop_rows()):
            logits = torch.empty(R, w, V, dtype=torch.float32, device=base.device) if return_logits else None
            ml.markov_loop(base, anchor_ids.long(), w1, w2, sampling.temperature, tokens, logits, q_out=q,
                           uniforms=u, bias_of=None if draft_bias is None else (lambda j: _slot_bias(draft_bias, j)))
            return tokens, logits
        # the slot's logits: the probs kernel reads them (sampled rows), or the caller wants them all
        logits = None
        if return_logits or q is not None:
            logits = torch.empty(R, w if return_logits else 1, V, dtype=torch.float32, device=base.device)
        for j in range(w):
            mt.markov_slot(base[:, j], anchor_ids.long() if j == 0 else tokens[:, j - 1], w1, w2, sampling.temperature,
                           tokens[:, j], None if logits is None else logits[:, j if return_logits else 0],
                           q_out=None if q is None else q[:, j], uniforms=None if q is None else u[j],
                           bias=None if draft_bias is None else _slot_bias(draft_bias, j))
        return tokens, (logits if return_logits else None)


def markov_loop_rows() -> int:
    """Up to how many rows the drafter drafts with the one-kernel-a-slot loop
    (models/markov_loop_triton.py): its MAX_ROWS, or ADASPEC_MARKOV_LOOP_ROWS from the environment
    (0: never; for A/B measurements, read when a step is drafted, so a graph keeps its capture's)."""
    env = os.environ.get("ADASPEC_MARKOV_LOOP_ROWS")
    if env is None:
        from adaspec.models import markov_loop_triton as ml

        return ml.MAX_ROWS
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"ADASPEC_MARKOV_LOOP_ROWS must be a whole number of rows, got {env!r}") from None


# The propose graph's bookkeeping around its matmuls and kernels, as pure functions: cuda_compiled
# fuses each into one or two kernels on CUDA, where as torch ops they were ~15 small kernels of
# the propose graph, each a few microseconds at one request (its graph is bound by kernel count).
@cuda_compiled
def block_token_ids(anchor_ids: torch.Tensor, k: int, mask_token_id: int) -> torch.Tensor:
    """[...] anchor ids -> [..., k]: the anchor, then k - 1 mask tokens."""
    slot = torch.arange(k, device=anchor_ids.device)
    return torch.where(slot == 0, anchor_ids.unsqueeze(-1), mask_token_id)


@cuda_compiled
def draft_uniforms(seeds: torch.Tensor, anchors: torch.Tensor, w: int) -> torch.Tensor:
    """Every slot's DRAFT uniform [w, R] in one call (the hash is elementwise: the same values as
    one call per slot), slot-major so that each slot's column is contiguous for the draw; slot j
    sits at position anchor + 1 + j."""
    slots = torch.arange(w, device=anchors.device)
    return keyed_uniforms_eager(seeds[None, :], anchors[None, :] + 1 + slots[:, None], DRAFT, anchors[None, :])


def confidence_logits(h: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor | None, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """The confidence head: h [..., d] final-normed, prev [...] the previous tokens -> [...] float32
    logits of proj([h ; W1[prev]]) (or of proj(h) without w1)."""
    if w1 is not None:
        h = torch.cat([h, F.embedding(prev, w1).to(h.dtype)], dim=-1)
    return F.linear(h, weight, bias).squeeze(-1).float()


def calibrated(conf_logits: torch.Tensor, temps: torch.Tensor, temps_greedy: torch.Tensor | None,
               greedy: torch.Tensor | None) -> torch.Tensor:
    """sigmoid(logit_j / T_j) over conf_logits [..., k]; rows flagged in greedy [R] take
    temps_greedy when it is given."""
    k = conf_logits.shape[-1]
    t = temps[:k]
    if temps_greedy is not None and greedy is not None:
        t = torch.where(greedy.unsqueeze(-1), temps_greedy[:k], t)
    return torch.sigmoid(conf_logits / t)


@cuda_compiled
def slot_confidences(h, anchor_ids, tokens, w1, weight, bias, temps, temps_greedy, temperature):
    """(calibrated confidences [R, w], their raw logits) of a drafted block: slot j reads h_j and
    the token before it (the anchor for slot 0); rows with temperature 0 take the greedy
    temperatures when there are some."""
    prev = torch.cat([anchor_ids[:, None].to(tokens.dtype), tokens[:, :-1]], dim=1)
    logits = confidence_logits(h, prev, w1, weight, bias)
    return calibrated(logits, temps, temps_greedy, temperature <= 0), logits


def _slot_bias(draft_bias: torch.Tensor, j: int) -> torch.Tensor:
    """Slot j's [R, V] of a draft bias given for every slot [R, V] or as (first slot, others) [R, 2, V]."""
    return draft_bias if draft_bias.dim() == 2 else draft_bias[:, min(j, 1)]


def block_attention_mask(anchors: torch.Tensor, T: int, k: int) -> torch.Tensor:
    """[B, 1, A*k, T + A*k] bool, True = visible. Keys: T context positions, then the A blocks.
    Query in block b sees context positions < anchors[b] and the k keys of block b only."""
    B, A = anchors.shape
    dev = anchors.device
    blk_of_q = torch.arange(A * k, device=dev) // k  # [A*k]
    a_q = anchors[:, blk_of_q]  # [B, A*k]
    ctx = torch.arange(T, device=dev)[None, None, :] < a_q[:, :, None]  # [B, A*k, T]
    own = (blk_of_q[:, None] == blk_of_q[None, :]).expand(B, -1, -1)  # [B, A*k, A*k]
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


# ---- checkpoints ----------------------------------------------------------------------
def save_drafter(model: DSparkDrafter, cfg: DrafterConfig, out_dir, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors with DeepSpec's tensor names."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        state[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(dtype or model.fc.weight.dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def save_drafter_config(cfg: DrafterConfig, out_dir) -> None:
    """Rewrite config.json only (e.g. after calibration), keeping the fields we do not model."""
    path = Path(out_dir) / "config.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    new = cfg.to_hf()
    if "torch_dtype" in old:
        new["torch_dtype"] = old["torch_dtype"]
    path.write_text(json.dumps(new, indent=2) + "\n")


def load_drafter_config(name_or_path) -> tuple[DrafterConfig, Path]:
    from adaspec.models.loader import model_dir, read_json

    path = model_dir(name_or_path)
    return DrafterConfig.from_hf(read_json(path / "config.json", "drafter config.json")), path


def load_drafter(name_or_path, target_cfg: ModelConfig | None = None, dtype=None, device="cpu"):
    """-> (DSparkDrafter in eval mode, DrafterConfig). With target_cfg, refuses a drafter made
    for another target."""
    from adaspec.models.loader import load_state_dict, load_weights, resolve_dtype

    device = torch.device(device)
    cfg, path = load_drafter_config(name_or_path)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    state = load_state_dict(path)
    with torch.device("meta"):
        model = DSparkDrafter(cfg)
    model = model.to_empty(device="cpu")
    load_weights(model, state, path)
    model = model.to(device=device, dtype=resolve_dtype(dtype, device)).eval()
    model.rope.build_tables(device=device)  # RoPE tables stay float32
    return model, cfg
