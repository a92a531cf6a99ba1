"""The engine-facing API (write_context / propose over a paged cache) against the training forward."""
import torch

from adaspec.sample.batch import SamplingBatch
from adaspec.sample.probs import processed_probs
from adaspec.sampling_params import SamplingParams
from adaspec.models.loader import load_target
from adaspec.train.drafter_loss import target_features

from .micro import random_drafter

BS = 4  # cache block size


class PagedCache:
    """What the engine does: scattered block tables, one K/V pair per drafter layer."""

    def __init__(self, drafter, num_blocks=64, seed=0):
        L, H, D = drafter.kv_cache_spec()
        self.caches = [(torch.zeros(num_blocks * BS, H, D), torch.zeros(num_blocks * BS, H, D)) for _ in range(L)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables = []

    def add(self, length):
        self.tables.append([self.free.pop() for _ in range((length + BS - 1) // BS)])
        return len(self.tables) - 1

    def slots(self, r, positions):
        return torch.tensor([self.tables[r][p // BS] * BS + p % BS for p in positions])

    def write(self, drafter, r, feats, positions):
        drafter.write_context(feats[positions], torch.tensor(positions), self.slots(r, positions), self.caches)


def _setup(micro_qwen3, R=3, T=40, k=5):
    target, tcfg = load_target(micro_qwen3)
    drafter, cfg = random_drafter(tcfg, target=target, block_size=k, layers=2)
    ids = torch.randint(4, tcfg.vocab_size, (R, T), generator=torch.Generator().manual_seed(1))
    _, feats = target_features(target, ids, cfg.target_layer_ids)
    cache = PagedCache(drafter)
    for r in range(R):
        cache.add(T + k)
    return drafter, cfg, ids, feats, cache


def _propose(drafter, cache, ids, anchors, temperature=None, top_p=None, top_k=None, seeds=None, tables=None,
             width=None):
    R = len(anchors)
    a = torch.tensor(anchors)
    params = [SamplingParams(temperature=0.0 if temperature is None else float(temperature[r]),
                             top_p=1.0 if top_p is None else float(top_p[r]),
                             top_k=0 if top_k is None else int(top_k[r])) for r in range(R)]
    sampling = SamplingBatch.build(params, seeds or list(range(R)), "cpu")
    return drafter.propose(ids[torch.arange(R), a], a, tables or cache.tables, BS, cache.caches, sampling,
                           return_logits=True, width=width)


def _train_reference(drafter, ids, feats, anchors, tokens):
    """Training forward at the same anchors, teacher-forced with the proposed tokens."""
    R = len(anchors)
    a = torch.tensor(anchors)
    with torch.no_grad():
        h = torch.cat([drafter.forward_train(ids[r:r + 1], feats[r:r + 1], a[r:r + 1].unsqueeze(0)) for r in range(R)])
        h = h[:, 0]  # [R, k, d]
        prev = torch.cat([ids[torch.arange(R), a].unsqueeze(1), tokens[:, :-1]], dim=1)
        return drafter.heads(h, prev)


def test_propose_matches_training_forward(micro_qwen3):
    drafter, cfg, ids, feats, cache = _setup(micro_qwen3)
    anchors = [7, 20, 33]
    for r, a in enumerate(anchors):
        cache.write(drafter, r, feats[r], list(range(a)))  # context = positions before the anchor
    prop = _propose(drafter, cache, ids, anchors)
    R, k, V = len(anchors), cfg.block_size, cfg.base.vocab_size
    assert prop.tokens.shape == (R, k) and prop.probs.shape == (R, k, V) and prop.confidences.shape == (R, k)
    logits, conf = _train_reference(drafter, ids, feats, anchors, prop.tokens)
    torch.testing.assert_close(prop.logits, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(prop.conf_logits, conf, rtol=0, atol=1e-5)
    torch.testing.assert_close(prop.confidences, torch.sigmoid(conf), rtol=0, atol=1e-6)
    assert torch.equal(prop.tokens, logits.argmax(-1))  # greedy: argmax of the biased logits
    assert torch.equal(prop.probs, torch.nn.functional.one_hot(prop.tokens, V).float())


def test_sampled_rows_use_processed_probs_and_keyed_draws(micro_qwen3):
    drafter, cfg, ids, feats, cache = _setup(micro_qwen3)
    anchors = [10, 10, 10]
    for r, a in enumerate(anchors):
        cache.write(drafter, r, feats[0], list(range(a)))  # same context in every row
    ids = ids.clone()
    ids[:, 10] = ids[0, 10]
    temp, top_p, top_k = torch.tensor([0.0, 1.3, 0.8]), torch.tensor([1.0, 0.9, 1.0]), torch.tensor([0, 0, 5])
    p1 = _propose(drafter, cache, ids, anchors, temp, top_p, top_k, seeds=[4, 5, 6])
    p2 = _propose(drafter, cache, ids, anchors, temp, top_p, top_k, seeds=[4, 5, 6])
    assert torch.equal(p1.tokens, p2.tokens)  # reproducible per request
    # a row's draws depend on its own seed only, not on its neighbours
    alone = _propose(drafter, cache, ids[1:2], [10], temp[1:2], top_p[1:2], top_k[1:2], seeds=[5],
                     tables=cache.tables[1:2])
    assert torch.equal(alone.tokens[0], p1.tokens[1])
    for j in range(cfg.block_size):
        want = processed_probs(p1.logits[:, j], temp, top_p, top_k)
        torch.testing.assert_close(p1.probs[:, j], want)
        assert bool((p1.probs[torch.arange(3), j, p1.tokens[:, j]] > 0).all())  # drawn from the support
    assert int((p1.probs[2] > 0).sum(-1).max()) <= 5  # top-k applied


def test_each_slot_draws_its_keyed_draft_uniform_and_q_goes_into_probs_out(micro_qwen3):
    """Slot j of a sampled row is the inverse-CDF draw from q_j with DRAFT(seed, anchor + 1 + j,
    anchor) (the uniforms of all slots come from one call: the same values as one per slot), and a
    given probs_out buffer receives q itself (the graphed step's static buffer: no copy after)."""
    from adaspec.sample.random import DRAFT, keyed_uniforms, sample_categorical

    drafter, cfg, ids, feats, cache = _setup(micro_qwen3)
    anchors = [10, 14, 20]
    for r, a in enumerate(anchors):
        cache.write(drafter, r, feats[r], list(range(a)))
    a = torch.tensor(anchors)
    params = [SamplingParams(temperature=t) for t in (1.0, 0.0, 0.7)]
    sampling = SamplingBatch.build(params, [11, 12, 13], "cpu")
    V = drafter.config.base.vocab_size
    buf = torch.full((3, cfg.block_size + 2, V), -1.0)
    out = buf[:, 1: cfg.block_size + 1]  # rows not contiguous with each other, each row contiguous
    with torch.no_grad():
        h = drafter.backbone_step(ids[torch.arange(3), a], a, cache.tables, BS, cache.caches)
        prop = drafter.draft_block(h, ids[torch.arange(3), a], a, sampling, probs_out=out)
    assert prop.probs.data_ptr() == out.data_ptr()
    assert (buf[:, 0] == -1).all() and (buf[:, -1] == -1).all()
    for j in range(cfg.block_size):
        u = torch.cat([keyed_uniforms(sampling.seeds[r:r + 1], a[r:r + 1] + 1 + j, DRAFT, a[r:r + 1]) for r in range(3)])
        assert torch.equal(prop.tokens[:, j], sample_categorical(out[:, j], u))
    assert torch.equal(out[1].argmax(-1), prop.tokens[1]) and bool((out[1].max(-1).values == 1).all())  # greedy row


def test_a_narrower_draft_is_the_full_blocks_first_slots(micro_qwen3):
    """width=w (an engine verifying at most w < block_size drafts): the heads run for w slots, and
    their drafts, q and confidences are the full block's first w, greedy and sampled rows alike."""
    drafter, cfg, ids, feats, cache = _setup(micro_qwen3)
    anchors = [10, 10, 10]
    for r, a in enumerate(anchors):
        cache.write(drafter, r, feats[0], list(range(a)))
    temp, top_p, top_k = torch.tensor([0.0, 1.3, 0.8]), torch.tensor([1.0, 0.9, 1.0]), torch.tensor([0, 0, 5])
    full = _propose(drafter, cache, ids, anchors, temp, top_p, top_k, seeds=[4, 5, 6])
    for w in (1, 3):
        part = _propose(drafter, cache, ids, anchors, temp, top_p, top_k, seeds=[4, 5, 6], width=w)
        assert part.tokens.shape == (3, w) and part.probs.shape[:2] == (3, w)
        assert torch.equal(part.tokens, full.tokens[:, :w])
        # equal up to the matmul's rounding (its blocking depends on the row count)
        torch.testing.assert_close(part.probs, full.probs[:, :w], rtol=0, atol=1e-6)
        torch.testing.assert_close(part.confidences, full.confidences[:, :w], rtol=0, atol=1e-6)
        torch.testing.assert_close(part.logits, full.logits[:, :w], rtol=0, atol=1e-5)


def test_rollback_and_block_scratch_slots(micro_qwen3):
    """A propose writes scratch K/V at anchor..anchor+k-1; positions before a later (or
    rolled-back, earlier) anchor are never disturbed once written by write_context."""
    drafter, cfg, ids, feats, cache = _setup(micro_qwen3, R=1)
    cache.write(drafter, 0, feats[0], list(range(30)))
    ref = _propose(drafter, cache, ids, [12])
    _propose(drafter, cache, ids, [20])  # scratch over positions 20..24
    again = _propose(drafter, cache, ids, [12])  # rolled back: same context as before
    torch.testing.assert_close(again.logits, ref.logits, rtol=0, atol=0)
    # moving forward: the engine writes the newly verified positions (12..27, which scratch
    # blocks overwrote), then proposes from the new anchor
    _propose(drafter, cache, ids, [25])
    cache.write(drafter, 0, feats[0], list(range(12, 28)))
    fwd = _propose(drafter, cache, ids, [28])
    logits, _ = _train_reference(drafter, ids, feats, [28], fwd.tokens)
    torch.testing.assert_close(fwd.logits, logits, rtol=0, atol=1e-5)


def test_kv_cache_spec(micro_qwen3):
    target, tcfg = load_target(micro_qwen3)
    drafter, cfg = random_drafter(tcfg, layers=3)
    assert drafter.kv_cache_spec() == (3, tcfg.num_key_value_heads, tcfg.head_dim)


def test_greedy_rows_use_greedy_temperatures(micro_qwen3):
    from dataclasses import replace

    drafter, cfg, ids, feats, cache = _setup(micro_qwen3, R=2)
    k = cfg.block_size
    t, tg = [2.0] * k, [0.5] * k
    drafter.config = replace(cfg, confidence_temperatures=t, confidence_temperatures_greedy=tg)
    for r in range(2):
        cache.write(drafter, r, feats[r], list(range(15)))
    prop = _propose(drafter, cache, ids, [15, 15], temperature=torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(prop.confidences[0], torch.sigmoid(prop.conf_logits[0] / 0.5))
    torch.testing.assert_close(prop.confidences[1], torch.sigmoid(prop.conf_logits[1] / 2.0))
    drafter.config = replace(cfg, confidence_temperatures=t)  # no greedy set: every row uses the other
    prop = _propose(drafter, cache, ids, [15, 15], temperature=torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(prop.confidences, torch.sigmoid(prop.conf_logits / 2.0))


def test_a_narrower_draft_gives_the_lm_head_a_contiguous_input(micro_qwen3):
    """The first w slots of a wider block reach the LM head as one contiguous [R, w, d] block: a
    strided view made F.linear a batched matmul reading the head's whole weight once per request
    (H100 run 70: 107 ms against 5 ms for the full block at 256 requests of the Qwen3-8B shape)."""
    drafter, cfg, ids, feats, cache = _setup(micro_qwen3)
    for r in range(3):
        cache.write(drafter, r, feats[0], list(range(10)))
    seen = []
    hook = drafter.lm_head.register_forward_pre_hook(lambda m, args: seen.append((tuple(args[0].shape),
                                                                                   args[0].is_contiguous())))
    try:
        for w in (None, 2):
            _propose(drafter, cache, ids, [10, 10, 10], width=w)
    finally:
        hook.remove()
    assert seen == [((3, cfg.block_size, cfg.base.hidden_size), True), ((3, 2, cfg.base.hidden_size), True)]
