"""Micro training on CPU: the loss falls, confidences track measured acceptance, STS helps;
and the three commands (train drafter / train calibrate / eval drafter) run end to end."""
import json

import numpy as np
import pytest
import torch

from adaspec.errors import AdaspecError
from adaspec.models.drafter import DrafterConfig, DSparkDrafter
from adaspec.train.calibrate import fit_and_report
from adaspec.train.drafter import init_drafter
from adaspec.train.drafter_eval import measure_blocks, summarize, walk_tau
from adaspec.train.drafter_loss import block_forward, cosine_lr, dspark_loss, sample_anchors

from .micro import MASK_ID, chain_sequences

STEPS = 80


@pytest.fixture(scope="module")
def trained(trained_target):
    target, tcfg, _ = trained_target
    cfg = DrafterConfig.from_target(tcfg, mask_token_id=MASK_ID, block_size=4, num_layers=1, markov_rank=8,
                                    target_layer_ids=[0, 1])
    drafter = DSparkDrafter(cfg)
    init_drafter(drafter, target, seed=0)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    data = chain_sequences(256, 48, seed=3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(STEPS):
        ids = data[torch.randint(0, data.shape[0], (8,), generator=g)]
        anchors = sample_anchors(8, 48, cfg.block_size, 16, g)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, STEPS, 3e-3)
        loss, _ = dspark_loss(block_forward(target, drafter, ids, anchors))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
    return target, drafter.eval(), losses


def test_micro_training_lowers_loss(trained):
    _, _, losses = trained
    assert np.mean(losses[-10:]) < 0.75 * np.mean(losses[:10])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_predicts_measured_acceptance(trained, temperature):
    target, drafter, _ = trained
    held_out = chain_sequences(16, 48, seed=99).tolist()  # sequences never trained on
    res = measure_blocks(target, drafter, held_out, [0] * len(held_out), temperature, seed=1)
    s = summarize(res)
    assert s["tau"] > 1.5  # the drafter learned something
    assert s["confidence_raw"]["auc"] > 0.6  # survival vs prefix acceptance, all slots
    assert s["confidence_raw"]["per_slot"][0]["auc"] > 0.6  # and within slot 1 alone


def test_walk_tau_follows_decoding():
    # one sequence: anchors 0 (2 accepted: next block at 3), 3 (1: at 5), 5 (0: at 6, past the end)
    assert walk_tau(np.array([2, 0, 5, 1, 0, 0]), np.zeros(6, dtype=int)) == (3 + 2 + 1) / 3
    # two sequences walk apart: the second starts at its own first anchor
    assert walk_tau(np.array([0, 9, 1, 0, 0]), np.array([0, 0, 1, 1, 1])) == (1 + 10 + 2 + 1) / 4
    assert walk_tau(np.full(20, 3), np.zeros(20, dtype=int)) == 4.0


def test_measured_blocks_know_their_sequences(trained):
    """Rows of a sequence are its anchors in order (what the walk needs), and summarize reports the
    walk beside tau; at T = 0 the walk visits only positions right after a rejection, never more
    tokens per step than the drafts allow."""
    target, drafter, _ = trained
    seqs = chain_sequences(6, 48, seed=7).tolist()
    seqs[2] = seqs[2][:30]
    starts = [0, 3, 0, 5, 0, 0]
    res = measure_blocks(target, drafter, seqs, starts, 0.0, batch_size=4)
    K = drafter.block_size
    assert np.bincount(res.seq).tolist() == [len(q) - K - st for q, st in zip(seqs, starts)]
    s = summarize(res)
    assert s["tau_walk"] == walk_tau(res.accepted, res.seq) and 1.0 <= s["tau_walk"] <= K + 1
    both = res.concat(res)
    assert both.seq.max() == 2 * res.seq.max() + 1 and walk_tau(both.accepted, both.seq) == s["tau_walk"]


def test_sts_does_not_increase_ece(trained):
    target, drafter, _ = trained
    seqs = chain_sequences(24, 48, seed=123).tolist()
    fit = measure_blocks(target, drafter, seqs[:12], [0] * 12, 1.0, seed=2)
    rep = measure_blocks(target, drafter, seqs[12:], [0] * 12, 1.0, seed=3)
    on_fit = fit_and_report(fit, fit)
    assert on_fit["after"]["per_slot"][0]["ece"] <= on_fit["before"]["per_slot"][0]["ece"] + 1e-12
    assert on_fit["after"]["ece"] <= on_fit["before"]["ece"] + 1e-12
    held = fit_and_report(fit, rep)
    assert held["after"]["ece"] <= held["before"]["ece"] + 0.01
    assert all(t > 0 for t in held["temperatures"])


def test_commands_end_to_end(trained_target, tmp_path, capsys):
    from adaspec.cli import main
    from adaspec.models.drafter import load_drafter

    _, tcfg, tdir = trained_target
    data = tmp_path / "seqs.npy"
    np.save(data, chain_sequences(64, 40, seed=7).numpy().astype(np.uint16))
    prompts = tmp_path / "prompts.npy"
    np.save(prompts, chain_sequences(6, 8, seed=8).numpy())
    out = tmp_path / "drafter"
    common = ["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(out), "--block-size", "3",
              "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4", "--anchors-per-seq", "8",
              "--log-every", "2", "--save-every", "2", "--save-dtype", "float32", "--device", "cpu"]
    assert main(common + ["--steps", "3"]) == 0
    assert main(common + ["--steps", "5", "--resume"]) == 0
    assert "resumed from step 3" in capsys.readouterr().out
    d, cfg = load_drafter(out, target_cfg=tcfg)
    assert cfg.block_size == 3 and cfg.mask_token_id == MASK_ID  # <|mask|> read from the tokenizer
    assert main(["train", "calibrate", "--target", str(tdir), "--drafter", str(out), "--prompts", str(prompts),
                 "--gen-len", "12", "--device", "cpu"]) == 0
    _, cfg = load_drafter(out)
    assert cfg.confidence_temperatures is not None and len(cfg.confidence_temperatures) == 3
    assert (out / "calibration.png").is_file()
    js, npz = tmp_path / "eval.json", tmp_path / "blocks" / "heldout_blocks.npz"
    assert main(["eval", "drafter", "--target", str(tdir), "--drafter", str(out), "--prompts", str(prompts),
                 "--gen-len", "12", "--device", "cpu", "--json", str(js), "--blocks-out", str(npz)]) == 0
    runs = json.loads(js.read_text())["runs"]
    assert [r["temperature"] for r in runs] == [0.0, 1.0]
    assert all(len(r["cond_acceptance"]) == 3 and r["tau"] >= 1.0 for r in runs)
    assert "confidence_calibrated" in runs[0]
    # the walk's blocks: their mean accepted length + 1 is the run's tau_walk, confidences calibrated
    with np.load(npz) as blocks:
        assert sorted(blocks.files) == ["T0_accepted", "T0_alpha", "T0_conf", "T1_accepted", "T1_alpha", "T1_conf"]
        for r, t in zip(runs, ("T0", "T1")):
            conf, acc, alpha = blocks[f"{t}_conf"], blocks[f"{t}_accepted"], blocks[f"{t}_alpha"].astype(np.float64)
            assert conf.shape == alpha.shape == (len(acc), 3) and ((conf >= 0) & (conf <= 1)).all() and (acc <= 3).all()
            assert float(np.mean(acc + 1.0)) == pytest.approx(r["tau_walk"])
            # each block's accepted drafts were drawn from its acceptance probabilities: none past a 0
            assert ((alpha >= 0) & (alpha <= 1)).all()
            assert all((alpha[i, : a] > 0).all() for i, a in enumerate(acc))
        a0, acc0 = blocks["T0_alpha"].astype(np.float64), blocks["T0_accepted"]
        assert set(np.unique(a0)) <= {0.0, 1.0}  # greedy: accepted or not, and the walk took all of them
        assert (np.cumprod(a0, axis=1).sum(1) == acc0).all()


def test_train_drafter_compile_falls_back_to_eager(trained_target, tmp_path, capsys, monkeypatch):
    """--compile (the code-0.6b preset's, for the GPU): a compiler that fails when the compiled
    step runs, or already when asked to compile, leaves an eager training that completes."""
    import torch.nn as nn

    from adaspec.cli import main
    from adaspec.models.drafter import load_drafter

    _, tcfg, tdir = trained_target
    data = tmp_path / "seqs.npy"
    np.save(data, chain_sequences(32, 40, seed=7).numpy().astype(np.uint16))

    def argv(out):
        return ["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(out), "--block-size",
                "3", "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4", "--anchors-per-seq", "8",
                "--steps", "3", "--log-every", "1", "--save-dtype", "float32", "--device", "cpu", "--compile"]

    def broken_compile(fn, *a, **kw):
        def run(*args, **kwargs):
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    assert main(argv(tmp_path / "d1")) == 0
    assert "compiled step failed (RuntimeError: inductor exploded); training eagerly" in capsys.readouterr().out
    load_drafter(tmp_path / "d1", target_cfg=tcfg)
    # the drafter's training pass compiled too: the retry must run it eagerly as well
    assert main(argv(tmp_path / "d3") + ["--compile-drafter"]) == 0
    assert "compiled step failed (RuntimeError: inductor exploded); training eagerly" in capsys.readouterr().out
    load_drafter(tmp_path / "d3", target_cfg=tcfg)

    def no_compiler(self, *a, **kw):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(nn.Module, "compile", no_compiler)
    assert main(argv(tmp_path / "d2")) == 0
    assert "torch.compile unavailable (no compiler here); training eagerly" in capsys.readouterr().err
    load_drafter(tmp_path / "d2", target_cfg=tcfg)


@pytest.mark.parametrize("flag, compiled", [([], False), (["--compile-drafter"], True)])
def test_compile_drafter_compiles_the_training_pass(trained_target, tmp_path, monkeypatch, flag, compiled):
    """--compile-drafter (with --compile) hands the drafter's forward_train to torch.compile; without
    it only the target's layers and the loss are compiled."""
    from adaspec.cli import main

    _, _, tdir = trained_target
    data = tmp_path / "seqs.npy"
    np.save(data, chain_sequences(32, 40, seed=7).numpy().astype(np.uint16))
    names = []

    def recording_compile(fn, *a, **kw):  # compiles nothing: records what it was given
        names.append(getattr(fn, "__name__", type(fn).__name__))
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    assert main(["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(tmp_path / "d"),
                 "--block-size", "3", "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4",
                 "--anchors-per-seq", "8", "--steps", "2", "--save-dtype", "float32", "--device", "cpu",
                 "--compile", *flag]) == 0
    assert "dspark_loss" in names and ("forward_train" in names) == compiled


def test_compile_drafter_without_compile_is_refused(trained_target, tmp_path, capsys):
    from adaspec.cli import main

    _, _, tdir = trained_target
    rc = main(["train", "drafter", "--target", str(tdir), "--data", str(tmp_path / "none.npy"), "--out",
               str(tmp_path / "d"), "--device", "cpu", "--compile-drafter"])
    assert rc != 0 and "--compile-drafter compiles on top of --compile: give both" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("minutes", ["0", "-1", "nan"])
def test_a_max_minutes_that_is_not_positive_is_refused(trained_target, tmp_path, capsys, minutes):
    from adaspec.cli import main

    _, _, tdir = trained_target
    rc = main(["train", "drafter", "--target", str(tdir), "--data", str(tmp_path / "none.npy"), "--out",
               str(tmp_path / "d"), "--device", "cpu", "--max-minutes", minutes])
    assert rc != 0 and f"--max-minutes {float(minutes)}: give a positive number of minutes" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("impl, fused, foreach", [("fused", True, None), ("foreach", None, True), ("auto", None, None)])
def test_drafter_optimizer_kernels(impl, fused, foreach):
    """--adamw-impl: fused or foreach as asked; auto takes the fused kernel on CUDA only (here: the
    default); every choice steps."""
    from adaspec.train.drafter import drafter_optimizer

    p = torch.nn.Parameter(torch.ones(4))
    opt = drafter_optimizer([p], 0.1, torch.device("cpu"), impl)
    assert (opt.defaults["fused"], opt.defaults["foreach"]) == (fused, foreach)
    p.grad = torch.ones(4)
    opt.step()
    assert torch.all(p < 1)


def test_drafter_optimizer_refuses_an_unknown_kernel():
    from adaspec.errors import AdaspecError
    from adaspec.train.drafter import drafter_optimizer

    with pytest.raises(AdaspecError, match="unknown AdamW implementation 'fast'"):
        drafter_optimizer([torch.nn.Parameter(torch.ones(1))], 0.1, torch.device("cpu"), "fast")


def test_heldout_rows_leave_training_and_are_measured_beside_training_rows(trained_target, tmp_path, monkeypatch):
    """--heldout-rows N: the last N rows never reach a training batch; at logged multiples of
    --heldout-every (and the last step) the log holds loss and per-slot soft acceptance on them and
    on the N training rows before them."""
    from adaspec.cli import main
    from adaspec.train import drafter_data

    _, _, tdir = trained_target
    rows = chain_sequences(32, 40, seed=7).numpy().astype(np.uint16)
    data = tmp_path / "seqs.npy"
    np.save(data, rows)
    trained_on = []
    real = drafter_data.RowSampler.__init__

    def spy(self, r, *a, **kw):
        trained_on.append(np.asarray(r).copy())
        real(self, r, *a, **kw)

    monkeypatch.setattr(drafter_data.RowSampler, "__init__", spy)
    out = tmp_path / "d"
    assert main(["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(out),
                 "--block-size", "3", "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4",
                 "--anchors-per-seq", "8", "--steps", "5", "--log-every", "1", "--heldout-rows", "4",
                 "--heldout-every", "2", "--save-dtype", "float32", "--device", "cpu"]) == 0
    assert len(trained_on) == 1 and np.array_equal(trained_on[0], rows[:-4])
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    measured = [r["step"] for r in log if "heldout" in r]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5] and measured == [2, 4, 5]
    for r in log:
        if "heldout" in r:
            for name in ("heldout", "train_rows"):
                assert np.isfinite(r[name]["loss"]) and len(r[name]["accept"]) == 3
                assert all(0.0 <= a <= 1.0 for a in r[name]["accept"])
            assert r["heldout"] != r["train_rows"]  # other rows, other figures


def test_heldout_rows_refusals():
    import argparse

    from adaspec.train.drafter import split_heldout

    rows = np.repeat(np.arange(32, dtype=np.uint16)[:, None], 40, axis=1)  # row i holds the token i

    def args(n, batch=4, seq=32, every=10):
        return argparse.Namespace(heldout_rows=n, batch_size=batch, seq_len=seq, heldout_every=every)

    assert split_heldout(rows, args(0)) == (rows, None)
    with pytest.raises(AdaspecError, match="positive multiple of --batch-size 4"):
        split_heldout(rows, args(6))
    with pytest.raises(AdaspecError, match="the sequences hold 32 rows; holding out 16 needs more than 32"):
        split_heldout(rows, args(16))
    with pytest.raises(AdaspecError, match="--heldout-every 0: give a number of steps"):
        split_heldout(rows, args(4, every=0))
    with pytest.raises(AdaspecError, match="hold 40 tokens, fewer than --seq-len 64"):
        split_heldout(rows, args(4, seq=64))
    train, sets = split_heldout(rows, args(8))
    assert train.shape == (24, 40) and sets["heldout"].shape == (8, 32) and sets["train_rows"].shape == (8, 32)
    # held out: the last 8 rows; measured as training rows: the 8 trained rows just before them (one
    # kind with the held-out ones: the self-distilled rows run greedy first, sampled last)
    assert sets["heldout"][:, 0].tolist() == list(range(24, 32))
    assert sets["train_rows"][:, 0].tolist() == list(range(16, 24))
    assert train[:, 0].tolist() == list(range(24))


def test_max_minutes_fits_the_steps_to_the_box(trained_target, tmp_path, monkeypatch, capsys):
    """--max-minutes through the loop (train/time_box.py, on a clock that moves 1 s a read): the
    first fit at step 40 has 1 s per 30 steps and 0.4 s left of 2.4, so 40 + 12 steps are trained
    (51 in floating point) and the schedule follows that total."""
    from adaspec.cli import main
    from adaspec.train import time_box

    clock = iter(range(1000))
    monkeypatch.setattr(time_box, "_now", lambda: float(next(clock)))
    _, _, tdir = trained_target
    data = tmp_path / "seqs.npy"
    np.save(data, chain_sequences(32, 40, seed=7).numpy().astype(np.uint16))
    out = tmp_path / "d"
    assert main(["train", "drafter", "--target", str(tdir), "--data", str(data), "--out", str(out),
                 "--block-size", "3", "--markov-rank", "4", "--seq-len", "32", "--batch-size", "4",
                 "--anchors-per-seq", "8", "--steps", "60", "--log-every", "4", "--max-minutes", "0.04",
                 "--save-dtype", "float32", "--device", "cpu"]) == 0
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    fitted = 40 + int((0.04 * 60 - 2.0) / (1.0 / 30))
    assert fitted in (51, 52) and log[-1]["step"] == fitted
    assert f"--max-minutes 0.04: 33 ms/step at step 40, training {fitted} steps" in capsys.readouterr().out
    # the cosine schedule ended with the fitted total: the last step's rate is its floor, not mid-way
    assert log[-1]["lr"] < 0.05 * max(r["lr"] for r in log)
