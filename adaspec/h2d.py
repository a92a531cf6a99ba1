"""Host-to-device copies that do not stall the GPU stream."""
from __future__ import annotations

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
    np_dtype = np.float64 if dtype.is_floating_point else np.int64  # float32's overflow to inf is torch's cast
    parts = [np.asarray(x, dtype=np_dtype).reshape(-1) for x in lists]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np_dtype)
    return list(torch.split(to_device(flat, device, dtype), [p.size for p in parts]))


_NUMPY_OF = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32}


def to_device_arrays(arrays, device) -> list[torch.Tensor]:
    """[(array-like, torch dtype)] -> tensors of those shapes and dtypes on `device`, through one
    copy of all their bytes (each piece 8-byte aligned, viewed back as its dtype: no cast kernel)."""
    parts, pieces, offset = [], [], 0
    for a, dtype in arrays:
        x = np.asarray(a, dtype=_NUMPY_OF[dtype])
        raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        pad = -raw.size % 8
        parts += [raw, np.zeros(pad, dtype=np.uint8)]
        pieces.append((offset, raw.size, x.shape, dtype))
        offset += raw.size + pad
    flat = to_device(np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8), device, torch.uint8)
    return [flat[o:o + n].view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype, device=flat.device)
            for o, n, shape, dtype in pieces]
