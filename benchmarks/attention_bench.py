"""Paged attention on the GPU: the Triton kernel vs the "varlen" backend (gather + flash varlen).

Checks correctness first (against the reference backend on a mixed decode/verify/prefill batch,
and against varlen on every timed shape), then times one attention call per shape: CUDA events,
median after warm-up, both eager launches and CUDA graph replay. Qwen3 head shapes (Hq 16 or
32, Hkv 8, D 128), bf16, block_size 16, shuffled block tables, batch 1/16/64/256, contexts
512/2048, q_len 1 (decode) and 8 (verify with 7 drafts). Arms:
  triton        the kernel, split-K count picked automatically (what backend "triton" runs)
  triton_nosplit the kernel with num_splits=1
  varlen        build_attention_metadata("varlen") metadata, gather K/V, flash varlen (the
                "varlen" backend's work, with enable_gqa=True where this torch needs it)
  varlen_paged  torch's varlen_attn reading the paged cache itself (block_table=), when this
                torch build supports it (recorded as an error otherwise)
Prints a table, writes $OUT/attention_bench.json (OUT defaults to ./out). About a minute.
    python3 benchmarks/attention_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaspec.engine.graph_capture import record_graph  # noqa: E402
from adaspec.models.attention import build_attention_metadata, paged_attention  # noqa: E402
from adaspec.models.paged_attention_triton import choose_block_q, choose_num_splits, paged_attention_triton  # noqa: E402

BLOCK_SIZE = 16
D = 128
HKV = 8


def make_batch(batch, ctx, q_len, hq, dtype, device, seed=0):
    """Every request has ctx keys already in the cache plus q_len new ones (kv_len = ctx + q_len)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv_lens = [ctx + q_len] * batch
    need = [-(-k // BLOCK_SIZE) for k in kv_lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    torch.manual_seed(seed)
    q = torch.randn(batch * q_len, hq, D, device=device, dtype=dtype)
    kc = torch.randn(num_blocks * BLOCK_SIZE, HKV, D, device=device, dtype=dtype)
    vc = torch.randn(num_blocks * BLOCK_SIZE, HKV, D, device=device, dtype=dtype)
    return q, kc, vc, tables, [q_len] * batch, kv_lens


def time_fn(fn, warmup=3, reps=20):
    """Median milliseconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_graph(fn, warmup=3, reps=20):
    """Capture fn into a CUDA graph (after an eager warm-up that JIT-compiles), time replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph, out = record_graph(fn)  # the collector paused (engine/graph_capture.py says why)
    ms = time_fn(graph.replay, warmup, reps)
    return ms, out


def arms_for(q, kc, vc, tables, q_lens, kv_lens, scale):
    """name -> zero-argument callable returning the output [T, Hq, D]; metadata built once."""
    dev = q.device
    m_tri = build_attention_metadata("triton", tables, q_lens, kv_lens, None, BLOCK_SIZE, dev)
    m_var = build_attention_metadata("varlen", tables, q_lens, kv_lens, None, BLOCK_SIZE, dev)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:  # the varlen arms then record this error
        err = e

        def varlen_attn(*a, **k):
            raise err

    # torch >= 2.13's varlen_attn refuses Hq != Hkv unless told enable_gqa=True (older ones lack the flag)
    try:
        gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    except (TypeError, ValueError):
        gqa = {}

    def varlen():  # what backend "varlen" does: gather this step's K/V, then flash varlen
        keys, values = kc[m_var.kv_gather_flat], vc[m_var.kv_gather_flat]
        return varlen_attn(q, keys, values, m_var.cu_q, m_var.cu_k, m_var.max_q, m_var.max_k, scale=scale,
                           window_size=(-1, 0), **gqa)

    def varlen_paged():  # flash varlen reading the paged cache itself, if this torch can
        nb = kc.shape[0] // BLOCK_SIZE
        return varlen_attn(q, kc.view(nb, BLOCK_SIZE, HKV, D), vc.view(nb, BLOCK_SIZE, HKV, D), m_tri.cu_q, None,
                           m_tri.max_q, m_tri.max_k, scale=scale, window_size=(-1, 0), seqused_k=m_tri.kv_lens,
                           block_table=m_tri.block_tables, **gqa)

    arms = {
        "triton": lambda: paged_attention(q, kc, vc, m_tri, scale),
        "triton_nosplit": lambda: paged_attention_triton(
            q, kc, vc, m_tri.block_tables, m_tri.cu_q, m_tri.kv_lens, scale, True,
            block_size=BLOCK_SIZE, max_q=m_tri.max_q, num_splits=1),
        "varlen": varlen,
    }
    arms["varlen_paged"] = varlen_paged
    return arms, m_tri


def check_mixed_batch(device, dtype):
    """Decodes, verifications and a prefill chunk in one batch, causal and block mode, vs reference."""
    out = {}
    q_lens = [1] * 6 + [8] * 4 + [96, 3]
    kv_lens = [513, 1, 2048, 40, 700, 17, 8, 1200, 64, 333, 600, 3]
    g = torch.Generator().manual_seed(1)
    need = [-(-k // BLOCK_SIZE) for k in kv_lens]
    perm = torch.randperm(sum(need) + 4, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    q = torch.randn(sum(q_lens), 32, D, device=device, dtype=dtype)
    kc = torch.randn((sum(need) + 4) * BLOCK_SIZE, HKV, D, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    for causal in (True, False):
        limits = None if causal else [[k] * n for n, k in zip(q_lens, kv_lens)]
        ref = paged_attention(q.float(), kc.float(), vc.float(),
                              build_attention_metadata("reference", tables, q_lens, kv_lens, limits, BLOCK_SIZE, device),
                              D ** -0.5)
        meta = build_attention_metadata("triton", tables, q_lens, kv_lens, limits, BLOCK_SIZE, device)
        for splits in (1, 4, None):
            o = paged_attention_triton(q, kc, vc, meta.block_tables, meta.cu_q, meta.kv_lens, D ** -0.5, causal,
                                       block_size=BLOCK_SIZE, max_q=meta.max_q, max_k=meta.max_k, num_splits=splits)
            err = (o.float() - ref).abs().max().item()
            out[f"{'causal' if causal else 'block'}_splits{splits}"] = err
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1 and 64, context 2048 only")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        sys.exit("attention_bench.py needs CUDA")
    device, dtype = torch.device("cuda"), torch.bfloat16
    import triton

    t0 = time.time()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "dtype": "bfloat16", "block_size": BLOCK_SIZE,
              "head_dim": D, "num_kv_heads": HKV, "rows": [], "errors": []}
    try:
        mixed = check_mixed_batch(device, dtype)
        report["mixed_batch_max_abs_err_vs_reference"] = mixed
        print("mixed batch vs reference (max abs err):", {k: f"{v:.2e}" for k, v in mixed.items()}, flush=True)
        ok = all(v < 3e-2 for v in mixed.values())
    except Exception:  # noqa: BLE001 - report it and still time what runs
        report["errors"].append(traceback.format_exc()[-3000:])
        print(report["errors"][-1], flush=True)
        ok = False
    report["mixed_batch_ok"] = ok
    if not ok:
        print("!! the Triton kernel disagrees with the reference on the mixed batch", flush=True)

    batches = [1, 64] if args.quick else [1, 16, 64, 256]
    ctxs = [2048] if args.quick else [512, 2048]
    hqs = [32] if args.quick else [16, 32]
    hdr = f"{'Hq':>3} {'B':>4} {'ctx':>5} {'q':>2} {'splits':>6} | " + " | ".join(
        f"{a:>14}" for a in ("triton", "triton_nosplit", "varlen", "varlen_paged")) + "   (ms eager / graph)"
    print(hdr, flush=True)
    for hq in hqs:
        for q_len in (1, 8):
            for ctx in ctxs:
                for batch in batches:
                    row = {"num_q_heads": hq, "batch": batch, "context": ctx, "q_len": q_len}
                    q, kc, vc, tables, q_lens, kv_lens = make_batch(batch, ctx, q_len, hq, dtype, device)
                    scale = D ** -0.5
                    arms, meta = arms_for(q, kc, vc, tables, q_lens, kv_lens, scale)
                    T = q.shape[0]
                    tiles = T // choose_block_q(q_len, hq // HKV) + batch
                    row["triton_splits"] = choose_num_splits(tiles, HKV, meta.max_k, device)
                    baseline = None
                    cells = []
                    for name in ("varlen", "triton", "triton_nosplit", "varlen_paged"):
                        try:
                            o = arms[name]()
                            torch.cuda.synchronize()
                            if name == "varlen":
                                baseline = o.float()
                            elif baseline is not None:
                                row[f"{name}_max_abs_err_vs_varlen"] = (o.float() - baseline).abs().max().item()
                            row[f"{name}_ms"] = time_fn(arms[name], reps=args.reps)
                            try:
                                row[f"{name}_graph_ms"], _ = time_graph(arms[name], reps=args.reps)
                            except Exception as e:  # noqa: BLE001 - recorded, the eager number still stands
                                row[f"{name}_graph_error"] = f"{type(e).__name__}: {e}"[:300]
                        except Exception as e:  # noqa: BLE001 - one arm failing must not end the run
                            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                            if name.startswith("triton"):
                                report["errors"].append(traceback.format_exc()[-2000:])
                    for name in ("triton", "triton_nosplit", "varlen", "varlen_paged"):
                        e, g = row.get(f"{name}_ms"), row.get(f"{name}_graph_ms")
                        cells.append("error" if e is None else f"{e:6.3f}/{g:6.3f}" if g is not None else f"{e:6.3f}/  -   ")
                    bad = [n for n in ("triton", "triton_nosplit") if row.get(f"{n}_max_abs_err_vs_varlen", 0) > 3e-2]
                    print(f"{hq:>3} {batch:>4} {ctx:>5} {q_len:>2} {row['triton_splits']:>6} | "
                          + " | ".join(f"{c:>14}" for c in cells) + (f"   MISMATCH {bad}" if bad else ""), flush=True)
                    report["rows"].append(row)
                    del q, kc, vc, arms, meta
                    torch.cuda.empty_cache()
    report["seconds"] = round(time.time() - t0, 1)
    path = out_dir / "attention_bench.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path} in {report['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
