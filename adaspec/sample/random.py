"""Counter-based randomness: every random number the engine draws is a hash of
(request seed, sequence position, purpose), never the next value of a stateful generator.

Why: with a per-request ``torch.Generator`` the k-th draw of a request depends on how many
draws came before it, which depends on the batch (whether a step drafted, how many slots the
scheduler granted, whether the adaptive policy skipped drafting), so a seeded request's text
changed under load. Keyed draws make "the token at position p" use the same uniform whatever
the batch, and they are plain elementwise tensor ops: no host loop over requests, nothing a
CUDA graph cannot capture, the same values on CPU and GPU.

Purposes (streams):
- SAMPLE: the one categorical draw that decides the token at position p (plain sampling, the
  bonus token, or the residual after a rejection). Keyed by position only, so the plain arm is
  reproducible whatever the batch.
- ACCEPT: the uniform of the accept test of the draft at position p, also keyed by the block's
  anchor position.
- DRAFT: the drafter's draw at position p, keyed by the anchor too: a position re-drafted from a
  later anchor gets fresh randomness, so confidences kept from an earlier step (which the
  adaptive budget reads) are independent of the current draft (VERIFY.md, "Losslessness").

Position p's final token is decided exactly once, and the three streams are independent, which
is all rejection sampling needs to stay lossless.

The hash works on 32-bit words held in int64 tensors; every product stays below 2**63, so
nothing relies on signed overflow.
"""
from __future__ import annotations

import torch

from adaspec.sample import kernels

SAMPLE, ACCEPT, DRAFT = 1, 2, 3

_M32 = 0xFFFFFFFF
_SEED_MAX = (1 << 64) - 1


def new_seeds(n: int, generator: torch.Generator | None = None) -> list[int]:
    """Fresh seeds for requests that did not ask for one, from `generator` (the engine's, seeded
    with EngineConfig.seed) or torch's global one (so a run of unseeded requests repeats, as in
    vLLM). One torch
    call for all of them: in the server every torch call of the engine thread hands the GIL to the
    event loop and may wait to get it back (one call per request took ~9% of the engine thread at
    256 streaming requests on the H200, BENCHMARKS.md run 5)."""
    return torch.randint(0, 1 << 62, (n,), dtype=torch.int64, generator=generator).tolist() if n else []


def seed_to_int64(seed: int) -> int:
    """Any integer seed in [-2**63, 2**64) as the int64 whose 64 bits are the seed's (mod 2**64)."""
    if not -(1 << 63) <= seed <= _SEED_MAX:
        raise ValueError(f"seed {seed} is outside the 64-bit range [-2**63, 2**64 - 1]")
    s = seed & _SEED_MAX
    return s - (1 << 64) if s >= (1 << 63) else s


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in two 16-bit halves of c (no int64 overflow)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply, full avalanche)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keyed_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int,
                   anchors: torch.Tensor | None = None) -> torch.Tensor:
    """U[0, 1) float32 of the shape of ``positions``, a pure function of its keys.

    seeds: [N] int64 (one per request); positions: [N] or [N, K] int64 sequence positions;
    anchors: optional, broadcastable to positions (the draft block's anchor position).
    """
    if _compiling and positions.is_cuda:
        fast = _compiled.get(stream) or _compile_stream(stream)
        try:
            return fast(seeds, positions, anchors)
        except Exception as e:  # noqa: BLE001 - a compiler failure: the eager hash gives the same values
            _give_up(e)
    return keyed_uniforms_eager(seeds, positions, stream, anchors)


def keyed_uniforms_eager(seeds: torch.Tensor, positions: torch.Tensor, stream: int,
                         anchors: torch.Tensor | None = None) -> torch.Tensor:
    """keyed_uniforms as plain torch ops, always (the same values): for code that is itself
    compiled (adaspec/cuda_compiled.py), where the hash fuses with the ops around it. stream must
    be a constant there (one of SAMPLE, ACCEPT, DRAFT; see _compiling below)."""
    return _hash(seeds, positions, stream * 0x9E3779B9 & _M32, anchors)


def _hash(seeds, positions, stream_key: int, anchors):
    seeds = seeds.to(torch.int64)
    while seeds.dim() < positions.dim():
        seeds = seeds.unsqueeze(-1)
    seed_lo, seed_hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32((positions.to(torch.int64) & _M32) ^ stream_key)
    if anchors is not None:
        h = _mix32(h ^ (anchors.to(torch.int64) & _M32))
    h = _mix32(h ^ seed_hi)
    h = _mix32(h ^ seed_lo)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


# keyed_uniforms for CUDA tensors compiled into one kernel (compile_for_cuda): written as torch
# ops the hash is ~50 integer kernels per call, and a speculative step makes several calls: on the
# H200 they were ~280 of a batch-1 step's ~975 kernels (BENCHMARKS.md, run 11). Integer operations
# and one exact conversion, so the compiled values equal the eager ones bit for bit. One compiled
# function per stream, whose key is a constant of its closure: passed as an argument, the stream
# became a symbolic integer that Inductor (torch 2.11) XORed as a float32, failing to compile.
_compiling = False
_compiled: dict = {}


def compile_for_cuda() -> None:
    """Use torch.compile'd hashes for CUDA tensors from now on (idempotent; CPU tensors keep the
    eager one). Called with models.fused.use_compiled, before CUDA graphs are captured; each
    stream compiles at its first call. A compiler failure falls back to the eager hash for good."""
    global _compiling
    _compiling = True


def _compile_stream(stream: int):
    key = stream * 0x9E3779B9 & _M32

    def hash_of_stream(seeds, positions, anchors):
        return _hash(seeds, positions, key, anchors)

    _compiled[stream] = torch.compile(hash_of_stream, dynamic=True, fullgraph=True)
    return _compiled[stream]


def _give_up(err: Exception) -> None:
    global _compiling
    if _compiling:
        import logging

        logging.getLogger("adaspec").warning("compiling keyed_uniforms failed (%s: %s); using the eager hash",
                                             type(err).__name__, str(err)[:300])
    _compiling = False
    _compiled.clear()


def sample_categorical(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of ``weights`` [M, V] (unnormalized, non-negative) by inverse CDF:
    the first index whose cumulative weight exceeds u * total. Zero-weight entries are never
    chosen; an all-zero row gives 0. On CUDA one Triton kernel (sample/triton_sampling.py)."""
    if kernels.use_triton(weights):
        return kernels.triton_sampling().draw(weights, uniforms)
    cum = weights.float().cumsum(-1)
    total = cum[:, -1:]
    # strictly below the total, so the last positive entry is the largest index reachable
    target = torch.minimum(uniforms.to(cum.dtype).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cum, target, right=True).squeeze(-1)
    return torch.where(total.squeeze(-1) > 0, idx.clamp_max(weights.shape[-1] - 1), torch.zeros_like(idx))
