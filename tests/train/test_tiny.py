"""The embedded default model `tiny`: shipped weights, loadable by name, generating Python."""
import json

import pytest
import torch

from adaspec.models.registry import resolve_model_path

TINY = resolve_model_path("tiny")
needs_weights = pytest.mark.skipif(
    not (TINY / "model.safetensors").is_file(),
    reason="tiny's weights are not committed yet (trained on the GPU machine by benchmarks/train_tiny.sh)",
)


@needs_weights
def test_tiny_is_small_and_documented():
    size = sum(p.stat().st_size for p in TINY.iterdir() if p.is_file())
    assert size <= 16 * 2**20
    stats = json.loads((TINY / "train_stats.json").read_text())
    assert 5e6 <= stats["params"] <= 10e6
    card = (TINY / "MODEL_CARD.md").read_text()
    for fig in ("parameters", "tokens seen", "validation loss", "Sample completions"):
        assert fig in card


@needs_weights
def test_tiny_loads_by_name_and_generates_python():
    from adaspec.models.loader import load_target
    from adaspec.train.card import greedy_complete
    from adaspec.train.tokenizer import load_raw

    model, cfg = load_target("tiny", dtype=torch.float32)
    assert cfg.architecture == "qwen3" and cfg.tie_word_embeddings
    tok = load_raw(TINY)
    out = greedy_complete(model, tok, "def fib(n):\n", max_new_tokens=24)
    assert out.strip() and out.startswith(" ")  # continues the function body, indented
    prompt = "import os\n\n\ndef main():\n    for name in os.listdir('.'):\n"
    out = greedy_complete(model, tok, prompt, max_new_tokens=24)
    assert out.startswith("        ")


@needs_weights
def test_tiny_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from adaspec.models.loader import load_target

    ours, cfg = load_target("tiny", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32).eval()
    ids = torch.randint(4, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.compute_logits(ours.forward_dense(ids)) - hf(ids).logits.float()).abs().max().item()
    assert diff < 1e-4
