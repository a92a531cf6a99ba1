"""Fixtures shared by the engine tests."""
import pytest

from adaspec.testing import make_micro_drafter_dir, make_micro_model_dir


@pytest.fixture(scope="module")
def graph_pair(tmp_path_factory):
    """A micro target (vocabulary 64, 2 layers) and a DSpark drafter that attends to its context (k = 4),
    for the CUDA-graph buffer tests (graph_buffers_setup.py)."""
    root = tmp_path_factory.mktemp("graphs")
    target = make_micro_model_dir(root / "t", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, init_std=0.3, seed=3,
                                  max_position_embeddings=128)
    drafter = make_micro_drafter_dir(root / "d", target, block_size=4, init_std=0.3, markov_rank=8, seed=4)
    return str(target), str(drafter)
