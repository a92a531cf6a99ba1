"""Does the compiled models/fused.qk_norm_rope_write_kv (ADASPEC_FUSED_KV_WRITE=1) write the paged
cache in place, or copy it? Compiled with inductor on this machine's device (the CPU's C++ backend
without a GPU), called on the k and v halves of caches laid out as allocate_kv_caches lays them out
(views of one storage), for a small cache and a large one, every layer in turn: a copy of the cache
would make the call's time grow with the cache, and one compiled graph should serve every layer.

    python3 benchmarks/probes/kv_write_inplace_probe.py [--slots 4096,2097152] [--layers 4] [--calls 20]

Prints the mean ms per call per cache size and the number of graphs dynamo compiled.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch._dynamo

from adaspec.models.fused import qk_norm_rope_write_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="4096,2097152", help="cache slots per layer, one run each")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch._dynamo.reset()
    compiled = torch.compile(qk_norm_rope_write_kv, dynamic=True, fullgraph=True)
    dev, Hq, Hkv, D, T = torch.device(args.device), 4, 2, 64, 3
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for S in (int(s) for s in args.slots.split(",")):
        storage = torch.zeros(args.layers, 2, S, Hkv, D, device=dev)
        q, k, v = (torch.randn(T, h, D, device=dev) for h in (Hq, Hkv, Hkv))
        pos, slots = torch.tensor([5, 6, 7], device=dev), torch.tensor([10, 11, S - 1], device=dev)
        cos, sin, qw, kw = (torch.randn(*shape, device=dev) for shape in ((100, D), (100, D), (D,), (D,)))
        per_layer = []
        for layer in range(args.layers):
            call = (q, k, v, pos, cos, sin, qw, kw, 1e-6, storage[layer, 0], storage[layer, 1], slots)
            compiled(*call)
            sync()
            t = time.perf_counter()
            for _ in range(args.calls):
                compiled(*call)
            sync()
            per_layer.append((time.perf_counter() - t) / args.calls * 1e3)
            assert storage[layer, 0, S - 1].abs().sum() > 0, "the keys were not written to the cache itself"
        gib = storage.numel() * storage.element_size() / 2**30
        print(f"{S:>9} slots ({gib:.2f} GiB of cache): {' '.join(f'{m:.3f}' for m in per_layer)} ms per call, layer by layer")
    print(f"dynamo: {dict(torch._dynamo.utils.counters['stats'])}")


if __name__ == "__main__":
    main()
