"""--cuda-graph-step (train/captured_step.py): the drafter's training step replayed as one graph
must train exactly as the ordinary steps do. On the CPU the captured step's static buffers and
replays run eagerly (graph_step_mode "eager"): the loop's plumbing (each batch copied in, the
cached rows' indices, the learning rate, the statistics read back) against ordinary steps; on a
GPU the real capture against ordinary steps."""
import json

import numpy as np
import pytest
import torch

from .micro import chain_sequences

ARGS = ["--block-size", "3", "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4", "--anchors-per-seq", "8",
        "--steps", "9", "--log-every", "1", "--save-dtype", "float32"]


def _losses(tdir, data, out, *extra):
    from adaspec.cli import main

    assert main(["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(out), *ARGS, *extra]) == 0
    return [json.loads(x)["loss"] for x in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "seqs.npy"
    np.save(path, chain_sequences(24, 32, seed=7).numpy().astype(np.uint16))
    return path


@pytest.mark.parametrize("cache", [False, True], ids=["live", "cached"])
def test_replays_of_the_captured_step_train_as_ordinary_steps(trained_target, data, tmp_path, monkeypatch, capsys, cache):
    import adaspec.train.drafter as drafter

    _, _, tdir = trained_target
    extra = ["--device", "cpu"] + (["--cache-target-features"] if cache else [])
    want = _losses(tdir, data, tmp_path / "plain", *extra)
    monkeypatch.setattr(drafter, "graph_step_mode", lambda args, device: "eager")
    got = _losses(tdir, data, tmp_path / "graph", *extra)
    assert "the training step runs as one CUDA graph from here" in capsys.readouterr().out
    assert len(got) == 9
    assert got == pytest.approx(want, rel=1e-6)


def test_a_failed_capture_trains_on_with_ordinary_steps(trained_target, data, tmp_path, monkeypatch, capsys):
    import adaspec.train.drafter as drafter
    from adaspec.train.captured_step import CapturedStep

    _, _, tdir = trained_target
    want = _losses(tdir, data, tmp_path / "plain", "--device", "cpu")

    def refused(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(drafter, "graph_step_mode", lambda args, device: "eager")
    monkeypatch.setattr(CapturedStep, "capture", refused)
    got = _losses(tdir, data, tmp_path / "graph", "--device", "cpu")
    assert ("capturing the training step as a CUDA graph failed (RuntimeError: operation not permitted when stream "
            "is capturing); training with ordinary steps") in capsys.readouterr().out
    assert got == pytest.approx(want, rel=1e-6)


def test_the_learning_rate_of_a_capturable_optimizer_is_written_in_place():
    """A captured AdamW reads its rate from the device tensor it was given: set_lr must write into
    that tensor (a new float would never reach the graph)."""
    from adaspec.train.drafter import set_lr

    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=torch.tensor(0.1))
    rate = opt.param_groups[0]["lr"]
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is rate and float(rate) == 0.25
    plain = torch.optim.AdamW([p], lr=0.1)
    set_lr(plain, 0.5)
    assert plain.param_groups[0]["lr"] == 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", [False, True], ids=["live", "cached"])
def test_the_captured_step_trains_as_ordinary_steps_on_gpu(trained_target, data, tmp_path, capsys, cache):
    """The real capture: gradients allocated in the graph and overwritten by each replay, AdamW's
    rate and step count on the device. bf16 autocast and atomics in the backward make two runs
    differ in the last bits, so the losses agree to a tolerance, step by step."""
    _, _, tdir = trained_target
    extra = ["--device", "cuda", "--compile", "--compile-drafter"] + (["--cache-target-features"] if cache else [])
    want = _losses(tdir, data, tmp_path / "plain", *extra)
    got = _losses(tdir, data, tmp_path / "graph", *extra, "--cuda-graph-step")
    out = capsys.readouterr().out
    assert "the training step runs as one CUDA graph from here" in out, out[-2000:]
    assert got == pytest.approx(want, rel=5e-3)
