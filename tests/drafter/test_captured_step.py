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


def test_a_resumed_optimizer_keeps_this_runs_implementation():
    """Loading a checkpoint replaces the groups' flags and rate with the saved run's: a run with
    --cuda-graph-step resumed from one without must stay capturable, with its device rate."""
    from adaspec.train.drafter import load_optimizer_state, set_lr

    p = torch.nn.Parameter(torch.ones(3))
    saved = torch.optim.AdamW([p], lr=0.1, foreach=True)
    p.grad = torch.ones(3)
    saved.step()
    rate = torch.tensor(0.2)
    mine = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=rate, foreach=False)
    load_optimizer_state(mine, saved.state_dict())
    group = mine.param_groups[0]
    assert group["foreach"] is False and group["lr"] is rate
    assert int(mine.state_dict()["state"][0]["step"]) == 1  # the state itself is the checkpoint's
    set_lr(mine, 0.05)
    assert float(rate) == pytest.approx(0.05)
    back = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.3)
    load_optimizer_state(back, mine.state_dict())  # a tensor rate saved, a float one wanted
    assert back.param_groups[0]["lr"] == pytest.approx(0.05) and not isinstance(back.param_groups[0]["lr"], torch.Tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", [False, True], ids=["live", "cached"])
def test_the_captured_step_trains_as_ordinary_steps_on_gpu(trained_target, data, tmp_path, capsys, cache):
    """The loop end to end with the real capture, the target's layers and the drafter's pass
    compiled. bf16 autocast and atomics in the backward make two runs differ in the last bits, so
    the losses agree to a tolerance, step by step: coarse (a review found gradients accumulated
    over the replays moved these losses by < 1e-3 on the CPU); the exact check of the replays'
    semantics is test_a_captured_step_trains_exactly_as_ordinary_steps."""
    _, _, tdir = trained_target
    extra = ["--device", "cuda", "--compile", "--compile-drafter"] + (["--cache-target-features"] if cache else [])
    want = _losses(tdir, data, tmp_path / "plain", *extra)
    got = _losses(tdir, data, tmp_path / "graph", *extra, "--cuda-graph-step")
    out = capsys.readouterr().out
    assert "the training step runs as one CUDA graph from here" in out, out[-2000:]
    assert got == pytest.approx(want, rel=5e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_captured_step_trains_exactly_as_ordinary_steps(device):
    """CapturedStep itself, on a small float32 model, as the loop uses it: 3 ordinary steps, then
    one capture and replays with a new batch and a new rate each step (on CUDA: a real graph on a
    side stream, its gradients allocated in the capture and overwritten by each replay, AdamW
    capturable with its rate on the device; on the CPU the replays run eagerly). The weights after
    12 steps must be an ordinary run's: accumulated gradients or a rate frozen at the capture
    would move them."""
    import contextlib

    from adaspec.train.captured_step import CapturedStep
    from adaspec.train.drafter import drafter_optimizer, set_lr

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g).to(dev), torch.randn(4, 1, generator=g).to(dev)) for _ in range(12)]
    rates = [0.05 * 0.8 ** i for i in range(12)]

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dev)
        params = list(model.parameters())
        opt = drafter_optimizer(params, rates[0], dev, "auto", capturable=cuda)

        def step(x, y):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            return loss.detach()
        return params, opt, step

    want, opt, step = make()
    for (x, y), rate in zip(batches, rates):
        set_lr(opt, rate)
        opt.zero_grad(set_to_none=True)
        step(x, y)
    got, opt, step = make()
    side = torch.cuda.Stream(dev) if cuda else None
    if cuda:
        side.wait_stream(torch.cuda.current_stream(dev))
    losses = []
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
        captured = None
        for i, ((x, y), rate) in enumerate(zip(batches, rates)):
            set_lr(opt, rate)
            if i < 3:
                opt.zero_grad(set_to_none=True)
                step(x, y)
                continue
            if captured is None:
                captured = CapturedStep(step, {"x": x, "y": y}, lambda: opt.zero_grad(set_to_none=True), eager=not cuda)
                captured.capture()
            captured.load(x=x, y=y)
            losses.append(float(captured.replay()))
    if cuda:
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
    assert len(set(losses)) == len(losses)  # each replay saw its own batch
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
