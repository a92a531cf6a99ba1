"""Greedy decode tokens/s of adaspec's engine vs transformers' generate, same weights, same run.

A ~7M-parameter random Qwen3 (vocab 8192, hidden 256, 6 layers, 4 heads x 64, 2 KV heads,
intermediate 768), float32, on this machine's CPU. Each arm: `--new` greedy tokens after a
`--prompt-len` prompt, at batch 1 and batch 16, `--repeats` runs, median reported.
Throughput = generated tokens / wall time of the whole generate call (prefill included).

    python benchmarks/engine_cpu_bench.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from adaspec import LLM, SamplingParams
    from adaspec.testing import make_micro_model_dir

    d = tempfile.mkdtemp()
    make_micro_model_dir(d, arch="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=1024, init_std=0.02)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters())
    llm = LLM(d, max_num_seqs=16)
    g = torch.Generator().manual_seed(0)
    rows = []
    for batch in (1, 16):
        prompts = torch.randint(10, 8000, (batch, args.prompt_len), generator=g)
        sp = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
        llm.generate([prompts[0].tolist()], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)  # warm-up
        times = {"adaspec": [], "transformers": []}
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = llm.generate([p.tolist() for p in prompts], sp, use_tqdm=False)
            times["adaspec"].append(time.perf_counter() - t)
            ours = [o.outputs[0].token_ids for o in outs]
            t = time.perf_counter()
            with torch.no_grad():
                ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new,
                                  min_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)
            times["transformers"].append(time.perf_counter() - t)
        same = ours == ref[:, args.prompt_len:].tolist()
        for arm, ts in times.items():
            med = statistics.median(ts)
            rows.append(dict(arm=arm, batch=batch, median_s=med, tok_per_s=batch * args.new / med,
                             spread_s=[min(ts), max(ts)], same_tokens_as_other_arm=same))
    base = {r["batch"]: r["tok_per_s"] for r in rows if r["arm"] == "transformers"}
    print(f"CPU: {platform.processor() or platform.machine()}, threads={args.threads}, params={params/1e6:.2f}M, "
          f"prompt={args.prompt_len}, new={args.new}, repeats={args.repeats}, float32, greedy")
    print(f"{'arm':<13}{'batch':>6}{'tok/s':>10}{'vs HF':>8}{'min-max s':>16}  same tokens")
    for r in rows:
        print(f"{r['arm']:<13}{r['batch']:>6}{r['tok_per_s']:>10.1f}{r['tok_per_s']/base[r['batch']]:>8.2f}"
              f"{r['spread_s'][0]:>8.2f}-{r['spread_s'][1]:.2f}  {r['same_tokens_as_other_arm']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(params=params, args=vars(args), rows=rows, torch=torch.__version__,
                           transformers=transformers.__version__), f, indent=2)


if __name__ == "__main__":
    main()
