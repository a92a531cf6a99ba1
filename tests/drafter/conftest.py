import pytest
import torch


@pytest.fixture(scope="session")
def trained_target(tmp_path_factory):
    """(model, cfg, path) of a micro target trained a little on a Markov-chain language."""
    from .micro import train_micro_target

    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("micro_target")
    model, cfg = train_micro_target(path)
    return model, cfg, path
