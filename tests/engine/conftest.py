"""Fixtures of the engine's statistical tests (test_spec_lossless.py, test_structured_outputs.py)."""
import pytest

from adaspec.testing import make_micro_drafter_dir, make_micro_model_dir


@pytest.fixture(scope="module")
def lossless_micro_pair(tmp_path_factory):
    """(target dir, drafter dir): a micro target with an 8-token vocabulary and a deliberately poor
    random drafter of block 3 (the chi-square tests of losslessness)."""
    root = tmp_path_factory.mktemp("lossless")
    target = make_micro_model_dir(root / "t", vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, init_std=0.5, seed=1,
                                  max_position_embeddings=32)
    drafter = make_micro_drafter_dir(root / "d", target, block_size=3, init_std=0.5, markov_rank=8, seed=2)
    return str(target), str(drafter)
