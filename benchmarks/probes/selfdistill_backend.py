"""GPU probe: the pair build's self-distillation decode (adaspec/train/self_distill.py sample_ragged)
on the "reference" attention (a gather of every row's cache, masked SDPA: H200 run 28 profiled it at
88 ms a step, 24 ms of it the gather) against the engine's backend for the device ("auto": the Triton
paged kernel), on a random-weight target of the code-0.6b preset's shape with the preset's batch
(768 sampled rows of 32-token prompts), and the decode steps replayed as one CUDA graph ("graphs":
the Triton kernel, sample_ragged's default on CUDA since ae1553a) against the same steps launched
eagerly ("auto"). Both orders of the two variants are run so neither pays the other's warm-up
alone. Checks that greedy rows agree (bf16: near ties may flip). Prints a table, writes
$OUT/selfdistill_backend.json.

    python3 benchmarks/probes/selfdistill_backend.py [--variants reference,auto] [--rows 768] [--gen 64]
    python3 benchmarks/probes/selfdistill_backend.py --variants auto,graphs --rows 1024 --gen 64
    python3 benchmarks/probes/selfdistill_backend.py --preset micro --rows 8 --gen 4   # CPU smoke test
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from adaspec.models.loader import load_target  # noqa: E402
from adaspec.train.self_distill import sample_ragged  # noqa: E402
from qwen3_shapes import write_preset_shape  # noqa: E402


def shaped_target(preset: str, vocab: int, device):
    shape = write_preset_shape(preset, vocab, tempfile.mkdtemp())
    model, _ = load_target(shape, dtype="bfloat16" if device.type == "cuda" else "float32", device=device,
                           load_format="dummy")
    return model


VARIANTS = {"reference": ("reference", False), "auto": ("auto", False), "graphs": ("auto", True)}  # backend, graphs


def timed(model, prompts, gen, temperature, variant, device) -> tuple[float, list]:
    backend, graphs = VARIANTS[variant]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rows = sample_ragged(model, prompts, gen, temperature, seed=0, batch_size=len(prompts), attention_backend=backend,
                         cuda_graphs=graphs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="code-0.6b")
    ap.add_argument("--rows", type=int, default=768)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--variants", default="reference,auto", help="two of " + ", ".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    if len(variants) != 2 or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: two of {list(VARIANTS)}")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = shaped_target(args.preset, args.vocab, device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, args.vocab, (args.rows, args.prompt_len), generator=g).tolist()
    for v in variants:  # first CUDA work: each variant's kernels
        timed(model, prompts[:8], 4, 1.0, v, device)
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": args.rows,
           "prompt_len": args.prompt_len, "gen": args.gen, "runs": []}
    greedy = {}
    for order in (variants, variants[::-1]):
        for variant in order:
            for temperature in (1.0, 0.0):
                s, rows = timed(model, prompts, args.gen, temperature, variant, device)
                res["runs"].append({"variant": variant, "backend": VARIANTS[variant][0],
                                    "cuda_graphs": VARIANTS[variant][1], "temperature": temperature, "seconds": s,
                                    "ms_per_step": 1e3 * s / args.gen})
                if temperature == 0.0:
                    greedy.setdefault(variant, rows)
    same = sum(a == b for a, b in zip(greedy[variants[0]], greedy[variants[1]]))
    res["greedy_rows_equal"] = same
    print(f"{'variant':<10}{'T':>4}{'ms/step':>10}  (the whole call: prefill, graph capture, decode steps)")
    for r in res["runs"]:
        print(f"{r['variant']:<10}{r['temperature']:>4g}{r['ms_per_step']:>10.2f}")
    print(f"greedy rows equal: {same} of {args.rows}")
    (out / "selfdistill_backend.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
