"""The pointwise parts of a decoder layer as pure functions, each compiled into one kernel on CUDA.

A decode step of a small model is bound by the number of kernels, not by bytes: written as
plain torch ops, RMSNorm is ~6 kernels, RoPE on q and k ~12, SwiGLU's activation 3, and every
residual add one more (../shared/spec/GPU.md: 4 ms for a 0.6B step in one CUDA graph, 8% of the
memory floor). `use_compiled()` swaps in torch.compile'd versions (dynamic shapes, so one
compilation serves every batch size; captured inside the CUDA graphs like any kernel), as
nano-vllm does per layer op. Eager stays the default (CPU, tests, training).

Numerics: the same formulas in float32 as the eager versions; compiled code may skip rounding an
intermediate to bf16, which changes results in the last bits only.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from adaspec.cuda_compiled import cuda_compiled
from adaspec.models.attention import write_kv


def _kv_write_from_env():
    """ADASPEC_FUSED_KV_WRITE: "triton" (the default since H100 run 58: its GPU tests passed; on
    the synthetic 0.6B shape at T = 1, no-spec and adaptive:7 1.07x faster at one request and
    1.03-1.04x at 64) runs the norms, RoPE and cache writes of a layer as one Triton kernel on CUDA
    (models/qk_norm_rope_triton.py); "1" (the default of run 57: no-spec 1.04-1.09x faster than
    "0", speculative arms 1.01-1.03x) writes the cache inside the compiled qk_norm_rope_write_kv;
    "0" keeps the separate index_copy_ writes. -> "triton", True or False (set_fused_kv_write's
    values)."""
    raw = os.environ.get("ADASPEC_FUSED_KV_WRITE", "triton").strip()
    if raw not in ("0", "1", "triton"):
        raise ValueError(f"ADASPEC_FUSED_KV_WRITE must be 0, 1 or triton, got {raw!r}")
    return "triton" if raw == "triton" else raw == "1"


_fused_kv_write = _kv_write_from_env()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(x + residual), x + residual): the residual add fused into the next norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float):
    """Per-head RMSNorm of q and k (Qwen3; skipped when the weights are None), then RoPE at
    `positions`. q [..., T, Hq, D], k [..., T, Hkv, D]."""
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    cos = cos_table[positions].unsqueeze(-2)
    sin = sin_table[positions].unsqueeze(-2)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_table: torch.Tensor, sin_table: torch.Tensor, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
    """qk_norm_rope, then the new keys and values written to the paged cache at `slots`
    (attention.write_kv) -> q. One function so that, compiled, the cache writes are stores of the
    kernels that make k and v rather than two index_copy_ kernels a layer: 56 of the ~300 kernels
    of a 28-layer decode step, 0.124 ms of its 1.29 ms of kernels at one request on the H100
    (BENCHMARKS.md, run 53's profile). On the CPU inductor fuses the norms, RoPE and both writes
    into one kernel and writes the cache in place, k_cache and v_cache being views of one storage
    (benchmarks/probes/kv_write_inplace_probe.py: the same time a call for a 20 MB and an 8 GB
    cache, one compiled graph for every layer)."""
    q, k = qk_norm_rope(q, k, positions, cos_table, sin_table, q_weight, k_weight, eps)
    write_kv(k_cache, v_cache, k, v, slots)
    return q


def fused_kv_write() -> bool:
    """Whether Attention.q_with_kv_written (the target's layers, the drafter's block) writes the cache
    inside qk_norm_rope_write_kv (compiled, or the Triton kernel)."""
    return bool(_fused_kv_write)


def kv_write_in_use(device) -> str:
    """How a run on `device` writes the cache, for result files and the cost tables' key: "fused"
    (switched on, on CUDA, where qk_norm_rope_write_kv is compiled once the engine captures its
    graphs; with --enforce-eager it runs the same writes as separate ops), "triton" (the one-kernel
    version, on CUDA, eager or graphed) or "index_copy" (switched off, or on the CPU, where the
    function runs eagerly: the same index_copy_ writes)."""
    if not _fused_kv_write or torch.device(device).type != "cuda":
        return "index_copy"
    return "triton" if _fused_kv_write == "triton" else "fused"


def set_fused_kv_write(flag) -> bool | str:
    """Switch it (tests, A/B runs): False, True or "triton"; returns the previous setting. Read at
    every forward, so a CUDA graph keeps what was set when it was captured."""
    global _fused_kv_write
    if flag != "triton":
        flag = bool(flag)
    old, _fused_kv_write = _fused_kv_write, flag
    return old


def _kernel_device(t: torch.Tensor) -> bool:
    """Where the Triton kernel runs (tests point it at the CPU, under Triton's interpreter)."""
    return t.is_cuda


def q_with_kv_written(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_table: torch.Tensor, sin_table: torch.Tensor, q_weight: torch.Tensor | None,
                      k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:
    """qk_norm_rope_write_kv as the layers run it: the Triton kernel where switched on
    ("triton"), on CUDA, for arguments it takes; else ops.qk_norm_rope_write_kv (compiled on CUDA
    once use_compiled() ran)."""
    args = (q, k, v, positions, cos_table, sin_table, q_weight, k_weight, eps, k_cache, v_cache, slots)
    if _fused_kv_write == "triton" and _kernel_device(q):
        from adaspec.models import qk_norm_rope_triton as kernel

        if kernel.unsupported(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots) is None:
            return kernel.launch(*args)
    return ops.qk_norm_rope_write_kv(*args)


def kv_written_by_kernel(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                         sin_table: torch.Tensor, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """Keys and values without queries (the drafter's context) through the Triton kernel, with
    no query heads, where q_with_kv_written would use it -> True; else False and nothing done
    (the caller runs the separate ops: the compiled function is not traced for zero heads)."""
    if _fused_kv_write != "triton" or not _kernel_device(k):
        return False
    from adaspec.models import qk_norm_rope_triton as kernel

    q = k[:, :0]  # [T, 0, D]: a grid of key/value heads only
    if kernel.unsupported(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots) is not None:
        return False
    kernel.launch(q, k, v, positions, cos_table, sin_table, k_weight, k_weight, eps, k_cache, v_cache, slots)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _Ops:
    """The implementations in use: each op is cuda_compiled (adaspec/cuda_compiled.py): the eager
    function for CPU tensors, its compiled version for CUDA tensors once use_compiled() ran."""

    _NAMES = ("rms_norm", "add_rms_norm", "qk_norm_rope", "qk_norm_rope_write_kv", "silu_mul")

    def __init__(self):
        for n in self._NAMES:
            setattr(self, n, cuda_compiled(globals()[n]))


ops = _Ops()


def use_compiled() -> None:
    """Compile the pointwise ops and the speculative step's bookkeeping for CUDA tensors
    (idempotent), and the samplers' keyed random numbers (sample/random.py). Called by the engine
    before it captures CUDA graphs; compilation happens at the first call of each function (the
    graphs' warm-up)."""
    from adaspec import cuda_compiled as compiled
    from adaspec.sample.random import compile_for_cuda

    compiled.enable()
    compile_for_cuda()
