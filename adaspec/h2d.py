"""Host-to-device copies that do not stall the GPU stream."""
from __future__ import annotations

import itertools

import numpy as np
import torch


def to_device(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list, numpy array or CPU tensor) as a tensor on `device`. On CUDA it goes
    through pinned memory and an asynchronous copy: a copy from pageable memory makes the driver
    wait for the stream first, a device sync hidden in an innocent-looking line (torch's sync
    debug mode flags some of them). The pinned buffer stays alive until the copy is done (torch's
    caching host allocator records the stream)."""
    t = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_device_many(lists, device, dtype=torch.int64) -> list[torch.Tensor]:
    """Several host lists of numbers as device tensors, through one copy (each copy of its own
    costs a pinned buffer and a launch)."""
    sizes = [len(x) for x in lists]
    np_dtype = np.float64 if dtype.is_floating_point else np.int64  # float32's overflow to inf is torch's cast
    flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np_dtype, count=sum(sizes))
    return list(torch.split(to_device(flat, device, dtype), sizes))
