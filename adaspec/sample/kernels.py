"""Which implementation of the sampler a tensor gets: the Triton kernels of
sample/triton_sampling.py for CUDA tensors, the torch ops of sample/probs.py and sample/random.py
for the rest (CPU, or CUDA with them switched off).

The switch exists for A/B measurements (benchmarks/probes/sampling_kernels.py) and as a way out:
ADASPEC_TRITON_SAMPLING=0 in the environment, or `set_enabled(False)`. The Triton module is
imported at the first CUDA call, never on a CPU-only run (its kernels are then only built by the
tests, under Triton's interpreter)."""
from __future__ import annotations

import importlib
import os

import torch

_enabled = os.environ.get("ADASPEC_TRITON_SAMPLING", "1") != "0"
_module = None
_missing = False  # triton did not import: remembered, since a failed import is retried (slowly) each time


def set_enabled(flag: bool) -> bool:
    """Use the Triton kernels for CUDA tensors from now on (or not); returns the previous setting."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


def use_triton(t: torch.Tensor) -> bool:
    """t goes through the Triton kernels: a CUDA tensor that needs no gradient (the kernels have
    no backward), with the kernels enabled and triton importable."""
    if not (_enabled and t.is_cuda) or (t.requires_grad and torch.is_grad_enabled()):
        return False
    return _available()


def _available() -> bool:
    global _missing
    if not _missing:
        try:
            triton_sampling()
        except ImportError:
            _missing = True
    return not _missing


def triton_sampling():
    """The kernels' module, imported once."""
    global _module
    if _module is None:
        _module = importlib.import_module("adaspec.sample.triton_sampling")
    return _module


def in_use(device) -> str:
    """What a run on `device` samples with, for result files: "triton" or "torch"."""
    return "triton" if torch.device(device).type == "cuda" and _enabled and _available() else "torch"


def markov_loop_in_use(device) -> str:
    """How a run on `device` drafts its Markov slots, for result files and the cost tables' key:
    "torch" (the torch ops), "fused" (models/markov_triton.py's kernels, on CUDA with the Triton
    sampler), or "fused+loopN" (up to N rows of a vocabulary of at most 16,384 in one kernel a slot,
    models/markov_loop_triton.py's serves; markov_triton's slots elsewhere)."""
    if in_use(device) != "triton":
        return "torch"
    from adaspec.models import markov_triton
    from adaspec.models.drafter import markov_loop_rows

    if not markov_triton.enabled():
        return "torch"
    rows = markov_loop_rows()
    return f"fused+loop{rows}" if rows > 0 else "fused"
