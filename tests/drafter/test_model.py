"""Drafter forward shapes, the block attention mask, and block isolation."""
import torch

from adaspec.models.drafter import block_attention_mask, default_target_layers
from adaspec.models.loader import load_target
from adaspec.train.drafter_loss import block_forward, dspark_loss, sample_anchors, target_features

from .micro import random_drafter


def _setup(micro_qwen3, **kw):
    target, tcfg = load_target(micro_qwen3)
    drafter, cfg = random_drafter(tcfg, target=target, **kw)
    return target, tcfg, drafter, cfg


def test_forward_shapes_and_frozen_parts(micro_qwen3):
    target, tcfg, drafter, cfg = _setup(micro_qwen3)
    B, T, k = 3, 24, cfg.block_size
    ids = torch.randint(4, tcfg.vocab_size, (B, T))
    anchors = sample_anchors(B, T, k, 5)
    assert anchors.shape == (B, 5) and int(anchors.min()) >= 1 and int(anchors.max()) <= T - 1 - k
    _, feats = target_features(target, ids, cfg.target_layer_ids)
    assert feats.shape == (B, T, len(cfg.target_layer_ids) * tcfg.hidden_size)
    h = drafter.forward_train(ids, feats, anchors)
    assert h.shape == (B, 5, k, tcfg.hidden_size)
    drafter.train()
    bb = block_forward(target, drafter, ids, anchors)
    assert bb.logits.shape == bb.target_logits.shape == (B, 5, k, tcfg.vocab_size)
    assert bb.conf_logits.shape == bb.tokens.shape == (B, 5, k)
    assert torch.equal(bb.tokens[:, :, 0], ids.gather(1, anchors + 1))
    loss, stats = dspark_loss(bb)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "markov_head.markov_w1.weight",
                 "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        assert dict(drafter.named_parameters())[name].grad is not None, name
    assert len(stats["accept"]) == k


def test_block_inputs_are_the_anchor_then_mask_tokens(micro_qwen3):
    """Slot 0 of a draft block embeds its anchor, slots 1..k-1 the mask token (DSPARK.md): what
    both forwards feed the backbone (a wrong slot trains and drafts alike, so no parity test sees it)."""
    _, _, drafter, cfg = _setup(micro_qwen3)
    k, mask = cfg.block_size, cfg.mask_token_id
    anchors = torch.tensor([[5, 9], [7, 11]])
    x = drafter.block_inputs(anchors)
    assert x.shape == (2, 2, k, drafter.embed_tokens.weight.shape[1])
    ids = torch.full((2, 2, k), mask)
    ids[..., 0] = anchors
    torch.testing.assert_close(x, drafter.embed_tokens(ids), rtol=0, atol=0)


def _reference_mask(anchors, T, k):
    B, A = anchors.shape
    ref = torch.zeros(B, A * k, T + A * k, dtype=torch.bool)
    for b in range(B):
        for i in range(A):
            for j in range(k):
                q = i * k + j
                for p in range(T):
                    ref[b, q, p] = p < int(anchors[b, i])  # context strictly before the anchor
                for i2 in range(A):
                    for j2 in range(k):
                        ref[b, q, T + i2 * k + j2] = i2 == i  # own block only, both directions
    return ref


def test_block_mask_matches_dense_reference():
    anchors = torch.tensor([[1, 4, 9], [0, 2, 12]])
    mask = block_attention_mask(anchors, 16, 3)
    assert mask.shape == (2, 1, 9, 16 + 9)
    assert torch.equal(mask[:, 0], _reference_mask(anchors, 16, 3))


def test_blocks_see_only_own_block_and_earlier_context(micro_qwen3):
    target, tcfg, drafter, cfg = _setup(micro_qwen3)
    T, k = 30, cfg.block_size
    ids = torch.randint(4, tcfg.vocab_size, (1, T))
    _, feats = target_features(target, ids, cfg.target_layer_ids)
    anchors = torch.tensor([[3, 8, 15, 21]])
    with torch.no_grad():
        together = drafter.forward_train(ids, feats, anchors)
        for i in range(anchors.shape[1]):
            a = int(anchors[0, i])
            alone = drafter.forward_train(ids, feats, anchors[:, i:i + 1])
            torch.testing.assert_close(together[:, i], alone[:, 0], rtol=0, atol=1e-5)
            # anything at or after the anchor (features) or other than the anchor (tokens) is invisible
            f2, ids2 = feats.clone(), ids.clone()
            f2[:, a:] = torch.randn_like(f2[:, a:])
            ids2[:, :a] = torch.randint(4, tcfg.vocab_size, (1, a))
            ids2[:, a + 1:] = torch.randint(4, tcfg.vocab_size, (1, T - a - 1))
            torch.testing.assert_close(drafter.forward_train(ids2, f2, anchors[:, i:i + 1]), alone, rtol=0, atol=1e-5)
            # ... while earlier context does matter
            f3 = feats.clone()
            f3[:, a - 1] += 1.0
            assert not torch.allclose(drafter.forward_train(ids, f3, anchors[:, i:i + 1]), alone)


def test_default_target_layers():
    assert default_target_layers(6) == [1, 3, 5]
    assert default_target_layers(36, 5)[0] == 1 and default_target_layers(36, 5)[-1] == 35
    assert default_target_layers(2) == [1]
