"""--gpu-memory-utilization sizes the KV cache as vLLM's does: the process may use that fraction
of the GPU, the weights already loaded take their part, the cache gets the rest; CPU ignores it."""
from __future__ import annotations

import pytest
import torch

from adaspec.config import EngineConfig
from adaspec.engine import kv_cache
from adaspec.errors import ConfigError

GiB = 2**30


def _blocks(monkeypatch, util, free, total, device="cuda", **cfg):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    c = EngineConfig(model="m", gpu_memory_utilization=util, max_num_seqs=10**6, **cfg)
    return kv_cache.num_kv_blocks(c, block_bytes=GiB // 1024, max_model_len=16, device=torch.device(device))


def test_the_cache_gets_the_fraction_minus_what_is_in_use(monkeypatch):
    # 100 GiB GPU, 20 GiB in use (weights): 0.5 leaves 30 GiB for the cache
    assert _blocks(monkeypatch, 0.5, free=80 * GiB, total=100 * GiB) == 30 * 1024
    assert _blocks(monkeypatch, 0.9, free=80 * GiB, total=100 * GiB) == 70 * 1024


def test_a_fraction_below_what_is_in_use_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.1 leaves no room"):
        _blocks(monkeypatch, 0.1, free=80 * GiB, total=100 * GiB)


def test_explicit_kv_sizes_win_and_cpu_ignores_it(monkeypatch):
    assert _blocks(monkeypatch, 0.5, 80 * GiB, 100 * GiB, kv_cache_memory=GiB) == 1024
    cpu = _blocks(monkeypatch, 0.5, 80 * GiB, 100 * GiB, device="cpu")
    assert cpu == kv_cache.DEFAULT_CPU_KV_BYTES // (GiB // 1024)
