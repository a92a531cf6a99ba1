"""Small pure tensor functions compiled into a few fused kernels for CUDA tensors.

A decode step of a small model, or of a speculative step at a few requests, is bound by the
number of kernels, not by bytes: each kernel costs a few microseconds even inside a CUDA graph.
Written as plain torch ops, a decoder layer's norms, RoPE and activation were ~20 kernels
(models/fused.py), and the speculative step's bookkeeping (the packed layout of the verify rows,
the accept test and stop distribution of rejection sampling, the adaptive allocation of draft
slots) ~100 more per step: H200 run 39's profile of one request at T = 1 spent ~0.37 ms of a
1.92 ms step in kernels outside the 15 largest, most of them a few microseconds each.

`cuda_compiled(fn)` wraps such a function: once `enable()` ran (the engine calls it before it
captures its CUDA graphs), calls whose first tensor argument is on a CUDA device run
torch.compile(fn) (dynamic shapes, so one compilation serves every batch size; compiled at the
first call, which is a graph's warm-up, never inside a capture), captured inside the graphs like
any kernel. CPU tensors, and everything before `enable()` (training, the CPU tests), run `fn`
itself, which stays the definition. A compiler failure falls back to `fn` for good, with a
warning: slower, never wrong.

Numerics: the same float32 formulas; a compiled kernel may keep an intermediate in registers
that eager code rounds, which moves results in the last bits only, and integer results are equal
(tests/engine/test_cuda_compiled_gpu.py compares each compiled function with its eager one).
"""
from __future__ import annotations

import functools
import logging

import torch

_enabled = False


def enable() -> None:
    """Compile the wrapped functions for CUDA tensors from now on (idempotent)."""
    global _enabled
    if _enabled:
        return
    # one process may run several dtypes, head sizes and draft widths (tests, benchmarks): each
    # is a recompile of these small functions, beyond dynamo's default limit of 8
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    _enabled = True


def enabled() -> bool:
    return _enabled


def _first_tensor(args) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _compiles_for(t: torch.Tensor) -> bool:
    """Whether a call whose first tensor is t runs compiled (once enabled)."""
    return t.is_cuda


class CudaCompiled:
    """fn for CPU tensors (and before enable()); torch.compile(fn) for CUDA ones after it."""

    def __init__(self, fn):
        self.eager = fn
        self._compiled = None
        self.failed: str | None = None  # why the compiled version was given up, if it was
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        first = _first_tensor(args)
        # inside another function being compiled, the outer compiler traces fn itself
        if _enabled and self.failed is None and first is not None and _compiles_for(first) \
                and not torch.compiler.is_compiling():
            if self._compiled is None:
                self._compiled = torch.compile(self.eager, dynamic=True, fullgraph=True)
            try:
                return self._compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a compiler failure: the eager function gives the same values
                out = self.eager(*args, **kwargs)  # bad inputs raise here too: then it was not the compiler
                self.failed = f"{type(e).__name__}: {str(e)[:300]}"
                logging.getLogger("adaspec").warning("compiling %s failed (%s); running it eagerly from now on",
                                                     self.eager.__name__, self.failed)
                return out
        return self.eager(*args, **kwargs)


def cuda_compiled(fn) -> CudaCompiled:
    """Decorator: see the module's docstring."""
    return CudaCompiled(fn)
