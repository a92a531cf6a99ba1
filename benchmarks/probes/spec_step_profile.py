"""GPU probe: what the graphed speculative step's two graphs cost against the no-spec engine's
decode graph, at small batches where per-user speed is decided. The Qwen3-0.6B shape with the
code-0.6b pair's vocabulary (16384), random weights, fixed:7 with synthetic acceptance (timing
only) and a stand-in drafter of --drafter-layers layers (default 1; the pair's has 2). After a few real steps (so the static buffers hold a real step's inputs) each graph is
replayed alone: ms per replay (CUDA events, 200 replays) and its kernels (torch.profiler, 20
replays: count and the top --top ones by time, 25 by default). --all-levels times the verify graph at every query
level (not only Q = k + 1) and --tables builds the adaptive engine instead, so each graph's time
stands beside what the policy's cost tables price it at (draft_ms(B), verify_ms(B * Q)).
--temperature 1 runs the requests at T = 1 with probabilistic drafts (the drafter samples each
slot), and --samplers torch,triton builds each engine twice, with the sampler's torch ops and with
its Triton kernels (sample/kernels.py), so their graphs stand side by side; `triton-unfused` is the
Triton sampler with the drafter's Markov loop as torch ops instead of its fused kernels
(models/markov_triton.py). Writes $OUT/spec_step_profile.txt.

    python3 benchmarks/probes/spec_step_profile.py [--batch 1,16] [--all-levels] [--tables]
    python3 benchmarks/probes/spec_step_profile.py --batch 1,64,256 --temperature 1 --samplers torch,triton
    python3 benchmarks/probes/spec_step_profile.py --batch 1,256 --temperature 1 --samplers triton-unfused,triton
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec import LLM, SamplingParams  # noqa: E402
from adaspec.models import markov_triton  # noqa: E402
from adaspec.sample import kernels  # noqa: E402
from offline_sweep import shape_model_dir  # noqa: E402

CURVE = [0.72, 0.68, 0.68, 0.71, 0.73, 0.78, 0.83]


def engine(n, spec, model_dir, adaptive=False, temperature=0.0, drafter_layers=1):
    cfg = {"method": "synthetic", "num_speculative_tokens": 7, "synthetic_acceptance": CURVE,
           "draft_sample_method": "probabilistic" if temperature > 0 else "greedy",
           "enable_adaptive_verification": adaptive,
           "synthetic_drafter": {"num_layers": drafter_layers}} if spec else None
    llm = LLM(model_dir, load_format="dummy", max_num_seqs=n, speculative_config=cfg, skip_tokenizer_init=True,
              max_model_len=2048)
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        eng.add_request(str(i), torch.randint(1, 10000, (64,), generator=g).tolist(),
                        SamplingParams(temperature=temperature, max_tokens=1500, ignore_eos=True, seed=i))
    for _ in range(20):
        eng.step()
    torch.cuda.synchronize()
    return eng


def time_replays(replay, n=200):
    for _ in range(10):
        replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def kernels_of(replay, n=20, top_n=25):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if (getattr(e, "self_device_time_total", 0) or 0) > 0]
    count = sum(e.count for e in evs) / n
    total = sum(e.self_device_time_total for e in evs) / n / 1e3
    top = sorted(evs, key=lambda e: -e.self_device_time_total)[:top_n]
    lines = [f"  {e.self_device_time_total / n:8.1f} us  x{e.count / n:5.1f}  {e.key[:110]}" for e in top]
    return count, total, "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--all-levels", action="store_true", help="every verify query level, not only k + 1")
    ap.add_argument("--tables", action="store_true", help="the adaptive engine, with its cost tables' prices")
    ap.add_argument("--no-kernels", action="store_true", help="times only (no torch.profiler pass)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per graph, by time (all: a large number)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--drafter-layers", type=int, default=1,
                    help="the stand-in drafter's layers (the code-0.6b pair's drafter has 2)")
    ap.add_argument("--samplers", default="default",
                    help="comma list of torch, triton, triton-unfused (default: the engine's)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = shape_model_dir("qwen3-0.6b", '{"vocab_size": 16384}')
    report = []
    T = args.temperature
    for n in (int(x) for x in args.batch.split(",")):
        for sampler in args.samplers.split(","):
            if sampler not in ("default", "torch", "triton", "triton-unfused"):
                raise SystemExit(f"--samplers: unknown sampler {sampler!r} (torch, triton, triton-unfused)")
            if sampler != "default":
                kernels.set_enabled(sampler != "torch")
                markov_triton.set_enabled(sampler != "triton-unfused")
            tag = "" if sampler == "default" else f" [{sampler} sampler]"
            plain = engine(n, False, model_dir, temperature=T)
            g = plain.runner.graphs
            key = g.pick(n, 1)
            graphs = {"none: decode graph": g.graphs[key].replay}
            spec = engine(n, True, model_dir, adaptive=args.tables, temperature=T, drafter_layers=args.drafter_layers)
            s = spec.spec.graphed
            b = next(x for x in s.batch_sizes if x >= n)
            cost = spec.spec.cost_model if args.tables else None
            priced = {"none: decode graph": float(cost.verify_ms(b)) if cost is not None else None}
            name = ("adaptive:7" if args.tables else "fixed:7") + \
                (f" ({args.drafter_layers}-layer drafter)" if args.drafter_layers != 1 else "")
            k = spec.spec.num_spec_tokens
            graphs[f"{name}: propose graph"] = s.propose_graphs[(b, k)].replay
            priced[f"{name}: propose graph"] = float(cost.draft_ms(b)) if cost is not None else None
            for q in (s.levels[1:] if args.all_levels else s.levels[-1:]):
                graphs[f"{name}: verify graph (Q={q})"] = s.verify_graphs[(b, q)].replay
                priced[f"{name}: verify graph (Q={q})"] = float(cost.verify_ms(b * q)) if cost is not None else None
            for name, replay in graphs.items():
                ms = time_replays(replay)
                price = f"; the tables price it at {priced[name]:.3f} ms" if priced.get(name) is not None else ""
                if args.no_kernels:
                    line = f"batch {n}, T = {T:g}{tag}: {name}: {ms:.3f} ms per replay{price}"
                    top = ""
                else:
                    count, total, top = kernels_of(replay, top_n=args.top)
                    line = (f"batch {n}, T = {T:g}{tag}: {name}: {ms:.3f} ms per replay, {count:.0f} kernels "
                            f"({total:.3f} ms of kernel time){price}")
                print(line, flush=True)
                report.append(f"==== {line}\n{top}\n")
            del plain, spec
            torch.cuda.empty_cache()
    (out_dir / "spec_step_profile.txt").write_text("\n".join(report))


if __name__ == "__main__":
    main()
