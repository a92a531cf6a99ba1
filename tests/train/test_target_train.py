import json
import math

import pytest
import torch


def test_micro_training_lowers_val_loss(micro_model):
    stats = json.loads((micro_model / "train_stats.json").read_text())
    hist = stats["history"]
    assert [h["step"] for h in hist] == [50, 100, 150]
    assert hist[-1]["val_loss"] < hist[0]["val_loss"] - 0.3
    assert stats["val_loss"] < math.log(512) - 1.5  # well below the uniform guess
    assert stats["tokens_seen"] == 150 * 16 * 64 and stats["params"] > 0
    for key in ("train_loss", "val_ppl", "wall_time_s", "device"):
        assert key in stats
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "checkpoint.pt"):
        assert (micro_model / name).is_file(), name
    assert json.loads((micro_model / "generation_config.json").read_text())["eos_token_id"] == 0


def test_checkpoint_matches_transformers_logits(micro_model):
    transformers = pytest.importorskip("transformers")
    from adaspec.models.loader import load_target

    ours, cfg = load_target(micro_model, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(micro_model), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours.compute_logits(ours.forward_dense(ids))
        b = hf(ids).logits.float()
    assert (a - b).abs().max().item() < 1e-4


def test_resume_continues_from_checkpoint(micro_corpus, micro_tokenizer, tmp_path, make_target_args):
    from adaspec.train.target import train_target

    out = tmp_path / "m"
    first = train_target(make_target_args(micro_corpus, micro_tokenizer, out, steps=30, eval_every=10))
    ck = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert ck["step"] == 30 and "optimizer" in ck and "sampler_rng" in ck
    second = train_target(make_target_args(micro_corpus, micro_tokenizer, out, steps=60, eval_every=10, resume=True))
    assert second["steps"] == 60 and second["tokens_seen"] == 2 * first["tokens_seen"]
    assert [h["step"] for h in second["history"]] == [10, 20, 30, 40, 50, 60]


def test_cli_target_runs(micro_corpus, micro_tokenizer, tmp_path):
    from adaspec.cli import main

    out = tmp_path / "cli"
    argv = ["train", "target", "--corpus", str(micro_corpus), "--tokenizer", str(micro_tokenizer), "--out", str(out),
            "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--intermediate", "64", "--seq-len", "32", "--batch-size", "4", "--steps", "5", "--eval-every", "5",
            "--eval-tokens", "256", "--device", "cpu", "--threads", "1"]
    assert main(argv) == 0
    stats = json.loads((out / "train_stats.json").read_text())
    assert stats["steps"] == 5
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.slow
def test_layer_compile_mode_and_no_checkpoints(micro_corpus, micro_tokenizer, tmp_path, make_target_args):
    """--compile-mode layers: every decoder layer compiled (one graph shared by all), training runs and
    learns; --checkpoint-every 0 writes no checkpoint.pt."""
    from adaspec.train.target import train_target

    out = tmp_path / "m"
    stats = train_target(make_target_args(micro_corpus, micro_tokenizer, out, steps=40, eval_every=20,
                                          compile=True, compile_mode="layers", checkpoint_every=0))
    assert stats["compiled"] and stats["history"][-1]["val_loss"] < stats["history"][0]["val_loss"]
    assert not (out / "checkpoint.pt").exists()
    eager = train_target(make_target_args(micro_corpus, micro_tokenizer, tmp_path / "e", steps=40, eval_every=20))
    assert abs(eager["val_loss"] - stats["val_loss"]) < 0.05  # same model, same batches: compiled == eager
