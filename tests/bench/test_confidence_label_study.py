"""benchmarks/confidence_label_study.py: the confidence head's form refitted on two labels, judged
by per-slot AUC for the greedy event on held-out sequences."""
import json

import numpy as np
import pytest
import torch

from adaspec.testing import load_benchmark

study = load_benchmark("confidence_label_study")


def test_a_fitted_head_ranks_a_separable_event_and_keeps_its_standardization():
    g = torch.Generator().manual_seed(0)
    x = 5.0 + 3.0 * torch.randn(400, 3, 4, generator=g)  # far from standardized on purpose
    label = (x[..., 0] - 5.0 > 0).float()
    head = study.fit_head(x, label, steps=200)
    logits = head(x).squeeze(-1).detach()
    assert all(a > 0.99 for a in study.slot_aucs(logits.numpy(), label.numpy()))
    # fitted on standardized features, applied to raw ones: the standardization travels with the head
    assert float(torch.nn.functional.binary_cross_entropy_with_logits(logits, label)) < 0.2


def test_slot_auc_counts_only_the_blocks_that_reach_the_slot():
    event = np.array([[1, 1], [1, 0], [0, 1], [0, 0]], dtype=float)
    score = np.array([[0.9, 0.8], [0.8, 0.1], [0.1, 0.99], [0.2, 0.99]])
    # slot 2 is reached by the first two blocks only: the two 0.99s of blocks 3-4 do not count
    assert study.slot_aucs(score, event) == [1.0, 1.0]


def test_the_study_on_the_tiny_pair_writes_every_heads_auc(tmp_path, capsys):
    out = tmp_path / "study.json"
    assert study.main(["--num-prompts", "8", "--gen-len", "24", "--steps", "20", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["blocks_fitted"] > 0 and doc["blocks_held_out"] > 0
    assert len(doc["slot_auc"]) == 4 and all(len(r) == 7 for r in doc["slot_auc"].values())
    assert all(0.0 <= a <= 1.0 for r in doc["slot_auc"].values() for a in r if a == a)
    assert "refitted on the greedy event" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        study.main(["--num-prompts", "2"])
