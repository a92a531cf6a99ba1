"""Sharded modules equal the unsharded model: each rank of a gloo group (2 ranks, and 4 ranks,
where the tiny model's 2 KV heads are replicated) runs the sharded forward and compares it with
the whole model's, in float32."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adaspec.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leave() -> None:
    """Both ranks passed: exit without the interpreter's teardown, where this torch build's gloo
    sometimes aborts ("terminate called without an active exception") after the checks are done."""
    import os
    import sys

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_checks(rank: int, size: int, port: int, llama_dir: str) -> None:
    """Both models' checks in one group: each spawned rank costs seconds of start-up (the llama
    checks alone took as long as their start-up), so the two share one spawn per size."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        _tiny_checks(rank, size)
        _llama_checks(rank, size, llama_dir)
    except BaseException:
        dist.destroy_process_group()
        raise
    _leave()


def _tiny_checks(rank: int, size: int) -> None:
    from adaspec.distributed.sharding import shard_drafter, shard_target
    from adaspec.models.drafter import load_drafter
    from adaspec.models.loader import load_target

    ids = torch.randint(0, 8192, (2, 11), generator=torch.Generator().manual_seed(0))
    full, _ = load_target("tiny", torch.float32)
    ref_hidden = full.forward_dense(ids)
    ref_logits = full.compute_logits(ref_hidden)
    for fuse_first in (False, True):  # sharding fused projections rebuilds the fused weight
        part, _ = load_target("tiny", torch.float32)
        if fuse_first:
            part.fuse_projections()
        shard_target(part, rank, size, dist.group.WORLD)
        if not fuse_first:
            part.fuse_projections()
        attn = part.model.layers[0].self_attn
        assert attn.num_heads == 4 // size and attn.num_kv_heads == max(1, 2 // size)
        assert part.lm_head.weight is part.model.embed_tokens.weight  # tied, sharded once
        hidden = part.forward_dense(ids)
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
        logits = part.compute_logits(hidden)
        assert logits.shape == ref_logits.shape
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))

    drafter, _ = load_drafter("tiny-dspark", dtype=torch.float32)
    feats = torch.randn(2, 11, 3 * 256, generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[1, 3], [0, 2]])
    ref = drafter.forward_train(ids, feats, anchors)
    ref_draft_logits = drafter.lm_head(ref).float()
    shard_drafter(drafter, rank, size, dist.group.WORLD)
    got = drafter.forward_train(ids, feats, anchors)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(drafter.lm_head(got).float(), ref_draft_logits, rtol=1e-5, atol=1e-5)
    assert drafter.kv_cache_spec() == (2, max(1, 2 // size), 64)


def _llama_checks(rank: int, size: int, model_dir: str) -> None:
    """Llama with q/k/v biases, an untied LM head and a vocabulary that does not split evenly
    (317 ids: the last shard is padded), through the loader's shard hook."""
    from adaspec.distributed.sharding import shard_target
    from adaspec.models.loader import load_target

    ids = torch.randint(0, 317, (2, 9), generator=torch.Generator().manual_seed(0))
    full, cfg = load_target(model_dir, torch.float32)
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    full.fuse_projections()
    ref = full.compute_logits(full.forward_dense(ids))
    part, _ = load_target(model_dir, torch.float32, shard=lambda m: shard_target(m, rank, size, dist.group.WORLD))
    part.fuse_projections()
    assert part.lm_head.weight.shape[0] == -(-317 // size)
    got = part.compute_logits(part.forward_dense(ids))
    assert got.shape == ref.shape == (2, 9, 317)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_models_equal_unsharded(size, tmp_path):
    """The tiny target and drafter, then a llama with biases and a padded vocabulary
    (_llama_checks), each rank's shards against the whole model, in one spawn per size."""
    from adaspec.testing import make_micro_model_dir

    d = make_micro_model_dir(tmp_path / "llama", arch="llama", seed=2, attention_bias=True, vocab_size=317)
    mp.spawn(_rank_checks, args=(size, _free_port(), str(d)), nprocs=size)


def test_vocab_shards_pad_the_last_rank():
    from adaspec.distributed.sharding import vocab_shard

    w = torch.arange(10.0).unsqueeze(1)  # 10 ids over 4 ranks: 3, 3, 3, 1 (+2 zero rows)
    shards = [vocab_shard(w, r, 4) for r in range(4)]
    assert [(s[1], s[2]) for s in shards] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert all(s[0].shape == (3, 1) for s in shards)
    assert shards[3][0].flatten().tolist() == [9.0, 0.0, 0.0]


def test_unshardable_sizes_are_refused():
    from adaspec.distributed.sharding import check_shardable
    from adaspec.models.loader import load_config, model_dir

    cfg = load_config(model_dir("tiny"))  # 4 heads, 2 KV heads, intermediate 768
    check_shardable(cfg, 4)  # KV heads replicated
    with pytest.raises(ConfigError, match="does not divide the 4 attention heads"):
        check_shardable(cfg, 3)
    with pytest.raises(ConfigError, match="does not divide the 4 attention heads"):
        check_shardable(cfg, 8)
