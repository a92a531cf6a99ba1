"""GPU step benchmarks of the engine on Qwen3 shapes with random weights (load_format="dummy").

1. Decode step time vs batch (512-token prompts): the engine's whole step (schedule, CUDA-graph
   replay, sampling, bookkeeping) as a user gets it, the device-to-host syncs of one step, and
   the fraction of the memory floor (weights + KV bytes / copy bandwidth measured in this run).
2. Verification step time vs query tokens per request (1, 2, 4, 8) at several batch sizes: the
   captured forward alone (refresh + replay), against the decode step and against
   max(bytes / bandwidth, FLOPs / matmul peak), both measured in this run.
3. (--draft-layers 1,2) one DSpark propose step (k = 7; one CUDA-graph replay, as the engine's
   speculative step runs it) of 1- and 2-layer drafters shaped after each target, against the
   target's decode step at the same batch.
   Host share of the decode step: 1 - (graph replay alone, part 2's q = 1) / (the whole step of
   part 1) at the same batch, i.e. the step time the GPU does not spend in the forward. Part 1
   runs with async scheduling (the engine's default on CUDA) and again without it (sync_*).
4. (--hf) transformers' generate with a static cache (compiled) on the same weights, same run.
5. (--mixed-chunk N) steps of B decodes plus one N-token prompt, as one mixed-graph replay
   (cudagraph_mode FULL) and split into the decode graph and an eager forward, same engine.

Prints a short table per part, writes everything to $OUT/decode_bench.json (default ./out).
Usage on the GPU machine: python3 benchmarks/decode_bench.py --shapes qwen3-0.6b,qwen3-8b
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen3_shapes import kv_bytes_per_token, param_count, write_shape  # noqa: E402

from adaspec.config import EngineConfig  # noqa: E402
from adaspec.engine.cuda_graphs import GraphedForward  # noqa: E402
from adaspec.engine.graph_capture import record_graph  # noqa: E402
from adaspec.engine.llm_engine import LLMEngine  # noqa: E402
from adaspec.sampling_params import SamplingParams  # noqa: E402
from adaspec.testing import device_sync_sites  # noqa: E402


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy (median of 10)."""
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * x.numel() * 2 / statistics.median(times[2:])


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    e.synchronize()
    return 10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3)


def decode_steps(eng: LLMEngine, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    for r in range(batch):
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        eng.add_request(f"b{batch}-{r}", ids, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    while not all(s.is_decoding for s in eng.scheduler.running) or eng.num_waiting():
        eng.step()
    eng.step()  # a first decode step (any lazy init)
    sites = step_sync_sites(eng) if eng.device.type == "cuda" else None
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    for s in list(eng.scheduler.running):
        eng.abort_request(s.request_id)
    eng.step()  # under async scheduling this also reads back the last step launched
    assert eng._in_flight is None
    return {"step_ms": 1e3 * statistics.median(times), "step_ms_p90": 1e3 * float(np.percentile(times, 90)),
            "syncs_per_step": None if sites is None else len(sites), "sync_sites": sites}


def step_sync_sites(eng: LLMEngine) -> list[str]:
    """Device-to-host syncs of one engine step: what CUDA's sync debug mode reports, plus the
    event waits it does not report: for sampled tokens under async scheduling, and for the
    graphed speculative step's results."""
    waits = eng.num_result_waits
    graphed = eng.spec.graphed if getattr(eng, "spec", None) is not None else None
    reads = graphed.num_read_backs if graphed is not None else 0
    sites = [s for s in device_sync_sites(eng.step) if not s.startswith("async_step.py")]
    sites += ["async_step.py:wait"] * (eng.num_result_waits - waits)
    if graphed is not None:
        sites += ["graphed_step.py:read_back"] * (graphed.num_read_backs - reads)
    return sites


def mixed_steps(eng: LLMEngine, batch: int, prompt_len: int, chunk: int, steps: int, vocab: int) -> dict:
    """Steps of `batch` decoding requests plus one new request's whole prompt of `chunk` tokens
    (the new request stops after its first token, so every step has the same shape): as one
    mixed-graph replay (cudagraph_mode FULL), then split into the decode graph and an eager
    forward on the same engine (the mixed graphs hidden), median ms per step each."""
    g = torch.Generator().manual_seed(1000 + batch)
    for r in range(batch):
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=g).tolist()
        eng.add_request(f"m{batch}-{r}", ids, SamplingParams(temperature=0, max_tokens=4 * steps + 16, ignore_eos=True))
    while not all(s.is_decoding for s in eng.scheduler.running) or eng.num_waiting():
        eng.step()
    graphs, out = eng.runner.graphs, {}
    for mode in ("mixed", "split"):
        saved = graphs.mixed_sizes
        if mode == "split":
            graphs.mixed_sizes = []  # pick_mixed finds nothing: the step splits
        before = (eng.runner.num_mixed_graph_steps, eng.runner.num_split_steps)
        times = []
        try:
            for i in range(steps + 3):
                ids = torch.randint(10, vocab - 10, (chunk,), generator=g).tolist()
                eng.add_request(f"m{batch}-{mode}-{i}", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                t0 = time.perf_counter()
                eng.step()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
        finally:
            graphs.mixed_sizes = saved
        out[f"{mode}_step_ms"] = 1e3 * statistics.median(times)
        out[f"{mode}_counts"] = [eng.runner.num_mixed_graph_steps - before[0], eng.runner.num_split_steps - before[1]]
    for s in list(eng.scheduler.running) + list(eng.scheduler.waiting):
        eng.abort_request(s.request_id)
    while eng.has_unfinished_requests():
        eng.step()
    return {"batch": batch, "chunk": chunk, **out}


def decode_both_ways(eng: LLMEngine, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """decode_steps with the engine's async scheduling (its default on CUDA), then without it on
    the same engine and requests: the step as users get it, and what the overlap saves."""
    r = decode_steps(eng, batch, prompt_len, steps, vocab)
    r["async_scheduling"] = eng.async_scheduling
    if eng.async_scheduling:
        eng.async_scheduling = False
        try:
            sync = decode_steps(eng, batch, prompt_len, steps, vocab)
        finally:
            eng.async_scheduling = True
        r.update(sync_step_ms=sync["step_ms"], sync_step_ms_p90=sync["step_ms_p90"],
                 sync_syncs_per_step=sync["syncs_per_step"])
    return r


def verify_costs(eng: LLMEngine, batches: list[int], qs: list[int], ctx: int, reps: int) -> list[dict]:
    """Replay time of captured forwards with q query tokens per request over ctx tokens of context."""
    bs = eng.config.block_size
    n_blocks = -(-(ctx + max(qs)) // bs)
    graphs = GraphedForward(eng.model, eng.kv_caches, bs, eng.device, max(batches), query_lens=tuple(qs),
                            max_model_len=eng.max_model_len, max_blocks_per_seq=n_blocks,
                            scratch_block=eng.scratch_block, capture_layers=None, batch_sizes=batches)
    graphs.capture()
    out = []
    for b in batches:
        tables = [[(r * n_blocks + i) % eng.num_blocks for i in range(n_blocks)] for r in range(b)]
        for q in qs:
            qlens = np.full(b, q, dtype=np.int64)
            starts = np.full(b, ctx, dtype=np.int64)
            ids = np.ones(b * q, dtype=np.int64)
            key = (b, q)
            for _ in range(3):
                graphs.run(key, ids, qlens, starts, tables)
            times = []
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graphs.run(key, ids, qlens, starts, tables)
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            # the forward alone on the GPU: back-to-back replays, no host refresh between them
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                graphs.graphs[key].replay()
            e.record()
            e.synchronize()
            out.append({"batch": b, "q": q, "ms": statistics.median(times), "gpu_ms": s.elapsed_time(e) / reps})
    del graphs
    torch.cuda.empty_cache()
    return out


def _median_ms(fn, reps: int, device: torch.device) -> float:
    """Median wall time of fn in ms: CUDA events on a GPU, perf_counter elsewhere (smoke tests)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def draft_costs(target_cfg, device: torch.device, dtype: torch.dtype, batches: list[int], ctx: int,
                layers: list[int], k: int = 7, reps: int = 10, block_size: int = 16) -> list[dict]:
    """Time of one DSpark propose step (backbone pass over the block, Markov loop, confidences) for
    R requests over ctx tokens of (random) drafter context, for drafters of `layers` backbone
    layers shaped after the target (dummy weights), as the engine runs it (Triton attention on
    CUDA, fused projections)."""
    from adaspec.engine.kv_cache import allocate_kv_caches
    from adaspec.models.drafter import DrafterConfig, DSparkDrafter
    from adaspec.models.loader import init_dummy_weights
    from adaspec.sample.batch import SamplingBatch

    out = []
    for n_layers in layers:
        cfg = DrafterConfig.from_target(target_cfg, mask_token_id=1, block_size=k, num_layers=n_layers)
        with torch.device("meta"):
            drafter = DSparkDrafter(cfg)
        drafter = drafter.to(dtype=dtype).to_empty(device=device)
        init_dummy_weights(drafter)
        drafter.rope.build_tables(device=device)
        drafter.attention_backend = "triton" if device.type == "cuda" else "reference"
        for layer in drafter.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        drafter.eval()
        n_kv_layers, n_kv, hd = drafter.kv_cache_spec()
        per_req = -(-(ctx + k) // block_size)
        for r in batches:
            caches = allocate_kv_caches(n_kv_layers, (r * per_req + 1) * block_size, n_kv, hd, dtype, device)
            for kc, vc in caches:
                kc.normal_()
                vc.normal_()
            tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(r)]
            ids = torch.randint(10, target_cfg.vocab_size - 10, (r,), device=device)
            pos = torch.full((r,), ctx, device=device, dtype=torch.int64)
            sampling = SamplingBatch.build([SamplingParams(temperature=0)] * r, list(range(r)), device)
            step = _propose_step(drafter, ids, pos, tables, block_size, caches, sampling, ctx, device)

            out.append({"drafter_layers": n_layers, "batch": r, "k": k, "draft_ms": _median_ms(step, reps, device)})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _propose_step(drafter, ids, pos, tables, block_size, caches, sampling, ctx, device):
    """The propose step as the engine runs it: on CUDA one graph replay of the backbone pass,
    Markov loop and confidences (spec_decode/graphed_step.py captures the same two calls); the
    block metadata is built once, before capture, since every replay reuses the same requests."""
    from adaspec.models.attention import build_attention_metadata

    r, k = ids.shape[0], drafter.block_size
    ends = [ctx + k] * r
    with torch.inference_mode():
        meta = build_attention_metadata(drafter.attention_backend, tables, [k] * r, ends, [[e] * k for e in ends],
                                        block_size, device)

    def run():
        with torch.inference_mode():
            h = drafter.backbone_forward(ids, pos, meta, caches)
            drafter.draft_block(h, ids, pos, sampling)

    if device.type != "cuda":
        return run
    run()  # warm-up: compiles, allocator
    torch.cuda.synchronize()
    graph, _ = record_graph(run)  # the collector paused (engine/graph_capture.py says why)
    return graph.replay


def hf_generate_step_ms(model_dir: Path, eng: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    """transformers generate, static cache (compiled by transformers), greedy, same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    hf.load_state_dict({k: v for k, v in eng.model.state_dict().items() if not k.startswith("rope.")}, strict=False)
    hf.eval()

    class Stamps(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    ids = torch.randint(10, cfg.vocab_size - 10, (batch, prompt_len), device="cuda")
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, cache_implementation="static",
              pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, **kw)  # compiles
        st = Stamps()
        hf.generate(ids, streamer=st, **kw)
    gaps = np.diff(st.t[2:])  # put #0 is the prompt, #1 the first token (prefill)
    del hf
    torch.cuda.empty_cache()
    return 1e3 * float(np.median(gaps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b,qwen3-8b")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--verify-batches", default="1,16,64,256")
    ap.add_argument("--verify-q", default="1,2,4,8")
    ap.add_argument("--hf", default="", help="shape:batch pairs for the transformers comparison, e.g. "
                                             "qwen3-0.6b:1,qwen3-4b:16")
    ap.add_argument("--draft-layers", default="", help="also time DSpark propose steps (k = 7) of drafters "
                                                     "with these backbone layer counts, e.g. 1,2 (benchmark 3)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--mixed-chunk", type=int, default=0,
                    help="also time steps of B decodes plus one prompt of this many tokens as a mixed graph and "
                         "split (the engine then runs with cudagraph_mode FULL; decode steps are the same either way)")
    ap.add_argument("--budget-s", type=float, default=500, help="skip remaining parts past this many seconds")
    args = ap.parse_args()
    t_start = time.perf_counter()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.batches.split(",")]
    bw, peak = copy_bandwidth(), matmul_peak()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s, "
          f"torch {torch.__version__}", flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bytes_per_s": bw,
              "matmul_flops_per_s": peak, "prompt_len": args.prompt_len, "steps": args.steps,
              "enforce_eager": args.enforce_eager, "decode": [], "verify": [], "draft": [], "hf": [], "mixed": [],
              "skipped": []}
    hf_pairs = [tuple(p.split(":")) for p in args.hf.split(",") if p]
    tmp = Path(tempfile.mkdtemp())
    for shape in args.shapes.split(","):
        if time.perf_counter() - t_start > args.budget_s:
            result["skipped"].append(f"{shape}: time budget")
            continue
        d = write_shape(shape, tmp)
        max_len = args.prompt_len + args.steps + 64
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig(
            model=str(d), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
            # --mixed-chunk: one slot more, for the prompt that joins the largest batch's decodes
            max_num_seqs=max(batches) + bool(args.mixed_chunk), max_model_len=max_len, max_num_batched_tokens=8192,
            num_kv_blocks=(max(batches) + 1) * (-(-max_len // 16)) + 8, enforce_eager=args.enforce_eager,
            cudagraph_mode="FULL" if args.mixed_chunk else "FULL_DECODE_ONLY"))
        startup = time.perf_counter() - t0
        weights = param_count(shape) * 2
        kvt = kv_bytes_per_token(shape)
        print(f"\n{shape}: {param_count(shape) / 1e9:.2f} B params, engine start {startup:.1f} s "
              f"(graphs: {eng.runner.graphs is not None})", flush=True)
        print(f"{'batch':>6} {'step ms':>9} {'p90':>7} {'floor ms':>9} {'of floor':>8} {'syncs':>5} {'sync-mode ms':>12}")
        for b in batches:
            r = decode_both_ways(eng, b, args.prompt_len, args.steps, 151936)
            ctx = args.prompt_len + args.steps / 2
            floor = 1e3 * (weights + b * ctx * kvt) / bw
            r.update(shape=shape, batch=b, floor_ms=floor, fraction_of_floor=floor / r["step_ms"])
            result["decode"].append(r)
            print(f"{b:>6} {r['step_ms']:>9.2f} {r['step_ms_p90']:>7.2f} {floor:>9.3f} "
                  f"{100 * r['fraction_of_floor']:>7.1f}% {r['syncs_per_step']:>5} {r.get('sync_step_ms', float('nan')):>12.2f} "
                  f"{' '.join(r['sync_sites']) if r['syncs_per_step'] > 1 else ''}", flush=True)
        if args.mixed_chunk and eng.runner.graphs is not None and time.perf_counter() - t_start < args.budget_s:
            print(f"{'batch':>6} {'mixed graph ms':>15} {'split ms':>9}   (B decodes + a {args.mixed_chunk}-token prompt)")
            for b in batches:
                r = mixed_steps(eng, b, args.prompt_len, args.mixed_chunk, args.steps, 151936)
                r.update(shape=shape)
                result["mixed"].append(r)
                print(f"{b:>6} {r['mixed_step_ms']:>15.2f} {r['split_step_ms']:>9.2f}   "
                      f"(steps by kind: {r['mixed_counts']} / {r['split_counts']})", flush=True)
        if not args.enforce_eager and time.perf_counter() - t_start < args.budget_s:
            vb = [int(x) for x in args.verify_batches.split(",")]
            vq = [int(x) for x in args.verify_q.split(",")]
            rows = verify_costs(eng, vb, vq, args.prompt_len, 20)
            print(f"{'batch':>6} " + " ".join(f"{'q=' + str(q):>8}" for q in vq) + f" {'q8/q1':>6} {'bound q8':>8}")
            for b in vb:
                ms = {r["q"]: r["ms"] for r in rows if r["batch"] == b}
                fl = 2 * param_count(shape) * b * max(vq)
                by = weights + b * (args.prompt_len + max(vq)) * kvt
                bound = 1e3 * max(by / bw, fl / peak)
                print(f"{b:>6} " + " ".join(f"{ms[q]:>8.2f}" for q in vq)
                      + f" {ms[max(vq)] / ms[min(vq)]:>6.2f} {bound:>8.2f}", flush=True)
                for r in rows:
                    if r["batch"] == b:
                        r.update(shape=shape, bound_ms_at_qmax=bound)
            result["verify"].extend(rows)
            # host share of the decode step: what the GPU does not spend in the forward
            for r in result["decode"]:
                fwd = next((v["gpu_ms"] for v in rows if v["batch"] == r["batch"] and v["q"] == 1), None)
                if r["shape"] == shape and fwd is not None:
                    r.update(forward_gpu_ms=fwd, host_share=max(0.0, 1 - fwd / r["step_ms"]))
                    if "sync_step_ms" in r:
                        r["sync_host_share"] = max(0.0, 1 - fwd / r["sync_step_ms"])
                    print(f"host share of the decode step at batch {r['batch']}: {100 * r['host_share']:.1f}% "
                          f"(forward {fwd:.2f} ms on the GPU, step {r['step_ms']:.2f} ms; without async "
                          f"scheduling {100 * r.get('sync_host_share', float('nan')):.1f}%)", flush=True)
        if args.draft_layers and time.perf_counter() - t_start < args.budget_s:
            rows = draft_costs(eng.model_config, eng.device, eng.dtype, batches, args.prompt_len,
                               [int(x) for x in args.draft_layers.split(",")])
            decode_ms = {r["batch"]: r["step_ms"] for r in result["decode"] if r["shape"] == shape}
            print(f"{'layers':>6} {'batch':>6} {'draft ms':>9} {'of decode step':>15}")
            for r in rows:
                r.update(shape=shape, decode_step_ms=decode_ms[r["batch"]],
                         fraction_of_decode=r["draft_ms"] / decode_ms[r["batch"]])
                print(f"{r['drafter_layers']:>6} {r['batch']:>6} {r['draft_ms']:>9.2f} "
                      f"{100 * r['fraction_of_decode']:>14.1f}%", flush=True)
            result["draft"].extend(rows)
        for s, b in hf_pairs:
            if s != shape:
                continue
            if time.perf_counter() - t_start > args.budget_s:
                result["skipped"].append(f"hf {s}:{b}: time budget")
                continue
            try:
                ms = hf_generate_step_ms(d, eng, int(b), args.prompt_len, args.steps)
                ours = next(r["step_ms"] for r in result["decode"] if r["shape"] == s and r["batch"] == int(b))
                result["hf"].append({"shape": s, "batch": int(b), "hf_step_ms": ms, "adaspec_step_ms": ours,
                                     "speedup": ms / ours})
                print(f"transformers generate (static cache, compiled) {s} batch {b}: {ms:.2f} ms/step; adaspec "
                      f"{ours:.2f} ms ({ms / ours:.2f}x)", flush=True)
            except Exception as e:  # report and go on: the engine's figures stand alone
                result["hf"].append({"shape": s, "batch": int(b), "error": f"{type(e).__name__}: {e}"[:500]})
                print(f"transformers comparison {s}:{b} failed: {type(e).__name__}: {e}"[:300], flush=True)
        del eng
        torch.cuda.empty_cache()
        (out_dir / "decode_bench.json").write_text(json.dumps(result, indent=1))
    (out_dir / "decode_bench.json").write_text(json.dumps(result, indent=1))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; skipped: {result['skipped'] or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
