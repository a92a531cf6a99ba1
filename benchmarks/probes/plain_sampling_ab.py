"""GPU probe: the no-spec engine's decode step at T = 1 with its sampling inside CUDA graphs
(engine/graphed_sampling.py) against the eager sampler after the forward's graph, and against
the greedy step (argmax, the floor sampling could reach), on the Qwen3-0.6B shape with the
code-0.6b pair's vocabulary (16384; random weights: timing only).

Per batch size: one engine; N seeded T = 1 requests decode; the two samplers alternate (A B A B...,
REPEATS pairs of STEPS steps each, the same engine and requests, async scheduling as the engine's
default on CUDA), wall ms per step; then GPU kernel ms per step of each (torch.profiler, 10 steps);
then the requests are replaced by greedy ones that walk the same steps (the same context lengths),
timed over as many blocks as the two T = 1 arms together. Prints a table, writes
$OUT/plain_sampling_ab.json.

    python3 benchmarks/probes/plain_sampling_ab.py [--batch 1,16,64,256] [--steps 40] [--repeats 3]
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaspec import LLM, SamplingParams  # noqa: E402
from offline_sweep import shape_model_dir  # noqa: E402
from plain_step_profile import kernel_ms  # noqa: E402


def add_requests(eng, n: int, temperature: float, tag: str) -> None:
    g = torch.Generator().manual_seed(n)
    for i in range(n):
        eng.add_request(f"{tag}{i}", torch.randint(1, 10000, (64,), generator=g).tolist(),
                        SamplingParams(temperature=temperature, seed=i, max_tokens=3000, ignore_eos=True))
    for _ in range(12):  # prefill, then decodes (graphs warm)
        eng.step()
    torch.cuda.synchronize()


def timed(eng, steps: int) -> float:
    """Wall ms per step over `steps` steps (synchronized at both ends)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / steps


def gpu_ms(eng) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    return kernel_ms(prof) / 10


def measure(n: int, model_dir: str, steps: int, repeats: int) -> dict:
    llm = LLM(model_dir, load_format="dummy", max_num_seqs=n, skip_tokenizer_init=True, max_model_len=4096)
    eng = llm.llm_engine
    sampler = eng._decode_sampler
    assert sampler is not None, "no sampling graphs were captured"
    arms = {"graph": sampler, "eager": None}
    add_requests(eng, n, 1.0, "t1-")
    wall = {a: [] for a in arms}
    for r in range(repeats):
        for a in (("graph", "eager") if r % 2 == 0 else ("eager", "graph")):
            eng._decode_sampler = arms[a]
            before = sampler.num_replays
            wall[a].append(timed(eng, steps))
            replayed = sampler.num_replays - before
            assert (replayed >= steps - 1) if a == "graph" else replayed == 0, (a, replayed)
    kern = {}
    for a in arms:
        eng._decode_sampler = arms[a]
        kern[a] = gpu_ms(eng)
    eng._decode_sampler = sampler
    for i in range(n):
        eng.abort_request(f"t1-{i}")
    while eng.has_unfinished_requests():
        eng.step()
    # the greedy requests walk the same steps as the T = 1 ones did (the same context lengths: a
    # decode step's attention grows with them; H200 run 35's first run timed half as many greedy
    # steps, at shorter contexts, so its greedy column was not comparable)
    add_requests(eng, n, 0.0, "t0-")
    greedy = [timed(eng, steps) for _ in range(2 * repeats)]  # over the contexts both T = 1 arms spanned
    greedy_gpu = gpu_ms(eng)
    gpu_ms(eng)
    eng.shutdown()
    row = {"batch": n, "steps": steps, "repeats": repeats,
           "t1_graph_ms": wall["graph"], "t1_eager_ms": wall["eager"], "greedy_ms": greedy,
           "t1_graph_gpu_ms": kern["graph"], "t1_eager_gpu_ms": kern["eager"], "greedy_gpu_ms": greedy_gpu}
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--shape-overrides", default='{"vocab_size": 16384}')
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = shape_model_dir(args.shape, args.shape_overrides)
    rows = []
    m = lambda xs: f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"  # noqa: E731
    print("batch | greedy ms/step | T=1 eager sampler | T=1 graph sampler | GPU ms: greedy / eager / graph", flush=True)
    for n in (int(x) for x in args.batch.split(",")):
        r = measure(n, model_dir, args.steps, args.repeats)
        rows.append(r)
        print(f"{n} | {m(r['greedy_ms'])} | {m(r['t1_eager_ms'])} | {m(r['t1_graph_ms'])} | "
              f"{r['greedy_gpu_ms']:.3f} / {r['t1_eager_gpu_ms']:.3f} / {r['t1_graph_gpu_ms']:.3f}", flush=True)
        torch.cuda.empty_cache()
    (out_dir / "plain_sampling_ab.json").write_text(json.dumps(
        {"commit": os.environ.get("ADASPEC_COMMIT"), "device": torch.cuda.get_device_name(), "shape": args.shape,
         "shape_overrides": args.shape_overrides, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
