"""KV cache sizing and allocation: one flat slot array per layer, addressed through block tables."""
from __future__ import annotations

import torch

from adaspec.config import EngineConfig
from adaspec.distributed.resident import register as register_kv_storage
from adaspec.errors import ConfigError

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB
DEFAULT_CUDA_KV_FRACTION = 0.3  # of the memory free after the weights are loaded


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def num_kv_blocks(cfg: EngineConfig, block_bytes: int, max_model_len: int, device: torch.device,
                  lookahead: int = 0) -> int:
    """Blocks to allocate: explicit count, else memory budget (kv_cache_memory, else what
    gpu_memory_utilization leaves on CUDA; CPU ignores it) / block bytes, capped at what
    max_num_seqs full-length requests could ever use. Refuses a cache that cannot hold one
    full-length request (the scheduler's preemption relies on it). lookahead: positions a request
    may write past max_model_len (a speculative draft block)."""
    per_seq = -(-(max_model_len + lookahead) // cfg.block_size)
    if cfg.num_kv_blocks is not None:
        n = cfg.num_kv_blocks
    else:
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif cfg.gpu_memory_utilization is not None and device.type == "cuda":
            # vLLM's meaning: this process may use that fraction of the GPU; the weights (and
            # whatever else is resident) are already in use, the KV cache gets the rest.
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free)
            if budget <= 0:
                raise ConfigError(
                    f"gpu_memory_utilization={cfg.gpu_memory_utilization} leaves no room for the KV cache: "
                    f"{(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB are in use after loading")
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * DEFAULT_CUDA_KV_FRACTION)
        else:
            budget = DEFAULT_CPU_KV_BYTES
        n = min(budget // block_bytes, per_seq * cfg.max_num_seqs + 1)
    if n < per_seq:
        draft = f", with its {lookahead}-position draft block" if lookahead else ""
        raise ConfigError(
            f"the KV cache holds {n} blocks of {cfg.block_size} tokens, fewer than one request of "
            f"max_model_len={max_model_len} needs ({per_seq}{draft}); raise num_kv_blocks / kv_cache_memory "
            "or lower max_model_len"
        )
    return int(n)


def allocate_kv_caches(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    storage = torch.zeros(num_layers, 2, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
    register_kv_storage(storage)  # tensor parallelism names caches by allocation order (distributed/resident.py)
    return [(storage[i, 0], storage[i, 1]) for i in range(num_layers)]
