"""--cache-target-features (train/feature_cache.py): the target's features of the training rows,
computed once, must be the features a step would compute (training with the cache follows the
same losses), a mixed batch's corpus rows still run the target after the cached rows, and rows a
window cannot match are refused."""
import json

import numpy as np
import pytest
import torch

from adaspec.errors import AdaspecError
from adaspec.train.drafter import batch_features, build_feature_cache, cached_rows
from adaspec.train.drafter_data import MixedSampler, RowSampler, StreamSampler
from adaspec.train.drafter_loss import target_features
from adaspec.train.feature_cache import TargetFeatureCache, cache_bytes

from .micro import chain_sequences

AMP = torch.autocast("cpu", enabled=False)


class _Args:
    batch_size = 4


def test_a_mixed_batch_gathers_its_cached_rows_and_computes_the_rest(trained_target):
    target, _, _ = trained_target
    layers = [0, 1]
    rows = chain_sequences(10, 24, seed=5).numpy()
    sampler = MixedSampler(RowSampler(rows, 24, 3, seed=1), StreamSampler(chain_sequences(1, 400, seed=6).numpy()[0],
                                                                           24, 2, seed=2))
    cache = build_feature_cache(_Args, target, sampler, layers, AMP, torch.device("cpu"))
    for _ in range(3):
        ids = sampler.next()
        got = batch_features(cache, target, cached_rows(cache, sampler, 24), ids, layers, AMP)
        with torch.no_grad():
            want = target_features(target, ids, layers)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        for g, w in zip(got, want):  # the cached rows first, then the corpus windows, as in ids
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert cache.hidden.shape[:2] == (10, 24)
    assert cache_bytes(10, 24, cache.hidden.shape[-1], len(layers), torch.float32) == \
        cache.hidden.numel() * 4 + cache.features.numel() * 4


@pytest.mark.parametrize("num_rows", [10, 3])
def test_every_row_is_cached_in_chunks_of_the_training_shape(trained_target, num_rows, monkeypatch):
    """The last chunk (and a set smaller than one batch) is padded to the batch's shape, so the
    compiled target sees one shape; every row's features are its own."""
    from adaspec.train import drafter_loss

    target, _, _ = trained_target
    rows = chain_sequences(num_rows, 24, seed=9)
    shapes, real = [], drafter_loss.target_features
    monkeypatch.setattr(drafter_loss, "target_features",
                        lambda t, ids, layers: shapes.append(tuple(ids.shape)) or real(t, ids, layers))
    cache = TargetFeatureCache.build(target, rows, [0, 1], AMP, 4)
    assert set(shapes) == {(4, 24)}
    with torch.no_grad():
        want = real(target, rows, [0, 1])
    torch.testing.assert_close(cache.hidden, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.features, want[1], rtol=1e-5, atol=1e-5)


def test_rows_longer_than_a_window_and_corpus_only_runs_are_refused(trained_target):
    target, _, _ = trained_target
    long_rows = RowSampler(chain_sequences(6, 40, seed=5).numpy(), 24, 2)
    with pytest.raises(AdaspecError, match="more than --seq-len 24"):
        build_feature_cache(_Args, target, long_rows, [0], AMP, torch.device("cpu"))
    stream = StreamSampler(chain_sequences(1, 400, seed=6).numpy()[0], 24, 2)
    with pytest.raises(AdaspecError, match="corpus windows only"):
        build_feature_cache(_Args, target, stream, [0], AMP, torch.device("cpu"))
    cache = TargetFeatureCache(torch.zeros(3, 24, 4), torch.zeros(3, 24, 8))
    with pytest.raises(AdaspecError, match="one window long"):
        cache.rows_on_device(torch.tensor([0]), torch.tensor([2]), 24)


def test_training_with_the_cache_follows_the_same_losses(trained_target, tmp_path):
    from adaspec.cli import main

    _, _, tdir = trained_target
    data = tmp_path / "seqs.npy"
    np.save(data, chain_sequences(24, 32, seed=7).numpy().astype(np.uint16))
    logs = {}
    for name, extra in (("live", []), ("cached", ["--cache-target-features"])):
        out = tmp_path / name
        assert main(["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(out),
                     "--block-size", "3", "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4",
                     "--anchors-per-seq", "8", "--steps", "6", "--log-every", "1", "--save-dtype", "float32",
                     "--device", "cpu", *extra]) == 0
        logs[name] = [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(logs["live"]) == 6
    assert logs["cached"] == pytest.approx(logs["live"], rel=1e-5)


def test_a_compiler_that_fails_while_caching_leaves_an_eager_run_with_the_cache(trained_target, tmp_path, capsys,
                                                                                 monkeypatch):
    """--compile: the target's first compiled forward is now the cache's build (and a mixed batch's
    corpus rows run it at a new shape); a compiler failure there must fall back to eager training
    as one in a step does, not end the run."""
    import torch.nn as nn

    from adaspec.cli import main

    _, _, tdir = trained_target
    data = tmp_path / "seqs.npy"
    np.save(data, chain_sequences(16, 32, seed=7).numpy().astype(np.uint16))
    real = nn.Module.compile

    def exploding_compile(self, *a, **kw):  # the compiled forward fails when it runs
        real(self, *a, **kw)
        self._compiled_call_impl = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("inductor exploded"))

    monkeypatch.setattr(nn.Module, "compile", exploding_compile)
    out = tmp_path / "d"
    assert main(["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(out),
                 "--block-size", "3", "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4",
                 "--anchors-per-seq", "8", "--steps", "3", "--log-every", "1", "--save-dtype", "float32",
                 "--device", "cpu", "--compile", "--cache-target-features"]) == 0
    text = capsys.readouterr().out
    assert "compiled step failed (RuntimeError: inductor exploded); training eagerly" in text
    assert "cached the target's features of 16 rows" in text
