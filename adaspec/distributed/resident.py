"""KV caches as tensors that every rank holds its own copy of. Rank 0 never sends them: a
mirrored call names them by allocation number (and view geometry), and the worker reads its own.

Every rank allocates its caches in the same order through engine/kv_cache.allocate_kv_caches
(the target's, then the drafter's), with the same local shapes, so allocation number n on rank
0 is allocation n on each worker. Numbers count from the tensor-parallel context's start
(`mark()`), so engines built earlier in the same process do not shift them."""
from __future__ import annotations

import weakref

import torch

_storages: list[weakref.ref] = []


def register(storage: torch.Tensor) -> None:
    """Called by allocate_kv_caches for every cache storage it creates."""
    _storages.append(weakref.ref(storage))


def mark() -> int:
    return len(_storages)


def lookup(t: torch.Tensor, base: int):
    """-> (allocation number, storage offset, size, stride) when t views a registered storage, else None."""
    ptr = t.untyped_storage().data_ptr()
    for n in range(len(_storages) - 1, base - 1, -1):
        s = _storages[n]()
        if s is not None and s.untyped_storage().data_ptr() == ptr:
            return n - base, t.storage_offset(), tuple(t.shape), tuple(t.stride())
    return None


def resolve(n: int, offset: int, size, stride, base: int) -> torch.Tensor:
    s = _storages[base + n]()
    if s is None:
        raise RuntimeError(f"KV cache allocation {n} of this tensor-parallel worker is gone")
    return s.as_strided(size, stride, offset)
