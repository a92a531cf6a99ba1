"""GPU probe: where a step of the code-0.6b pair's drafter training goes (adaspec/train/drafter.py:
block_forward + dspark_loss + backward + AdamW), on a random-weight target of the preset's shape
(Qwen3-0.6B, vocabulary 16384) and random tokens, with the preset's batch (32 x 256 tokens, 64
anchors per sequence, k = 7, 1 layer). Prints ms per step and the top CUDA kernels, split into the
frozen target's forward and the rest. Writes $OUT/drafter_train_profile.txt.

    python3 benchmarks/probes/drafter_train_profile.py [--steps 20] [--compile]
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
from adaspec.models.drafter import DrafterConfig, DSparkDrafter  # noqa: E402
from adaspec.models.loader import load_target  # noqa: E402
from adaspec.train.drafter import _compile, init_drafter  # noqa: E402
from adaspec.train.drafter_loss import block_forward, dspark_loss, sample_anchors, target_features  # noqa: E402
from adaspec.train.pair_presets import PRESETS  # noqa: E402
from qwen3_shapes import write_shape  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--preset", default="code-0.6b", help="micro: a CPU smoke test of this script")
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--compile", action="store_true", help="then time the compiled step too (profiled last)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    preset = PRESETS[args.preset]
    t, d = preset["target"], preset["drafter"]
    shape = write_shape("qwen3-0.6b", tempfile.mkdtemp())
    cfg = json.loads((shape / "config.json").read_text())
    cfg.update(vocab_size=args.vocab, num_hidden_layers=t["layers"], hidden_size=t["hidden"],
               intermediate_size=t["intermediate"], num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"],
               head_dim=t["head_dim"], max_position_embeddings=t["max_position"], bos_token_id=1, eos_token_id=2)
    (shape / "config.json").write_text(json.dumps(cfg))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    target, tcfg = load_target(shape, dtype="bfloat16" if cuda else "float32", device=dev, load_format="dummy")
    for p in target.parameters():
        p.requires_grad_(False)
    dcfg = DrafterConfig.from_target(tcfg, mask_token_id=3, block_size=d["block_size"], num_layers=d["layers"],
                                     markov_rank=d["markov_rank"])
    drafter = DSparkDrafter(dcfg)
    init_drafter(drafter, target, 0, from_target=True)
    drafter.to(dev)
    drafter.rope.build_tables(device=dev)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    B, T, A = d["batch_size"], d["seq_len"], d["anchors_per_seq"]
    g = torch.Generator().manual_seed(0)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    loss_fn = [dspark_loss]

    def step():
        ids = torch.randint(4, args.vocab, (B, T), generator=g).to(dev)
        anchors = sample_anchors(B, T, dcfg.block_size, A, g).to(dev)
        with amp:
            bb = block_forward(target, drafter, ids, anchors)
        loss, _ = loss_fn[0](bb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def target_only():
        ids = torch.randint(4, args.vocab, (B, T), generator=g).to(dev)
        with amp, torch.no_grad():
            target_features(target, ids, dcfg.target_layer_ids)

    def compile_all():
        loss_fn[0], ok = _compile(target, dspark_loss)
        assert ok, "torch.compile failed"

    lines = []
    runs = [("full step", step), ("target features only", target_only)]
    if args.compile:  # the same, compiled as `train drafter --compile` does (warm-up steps compile)
        runs += [("compile", compile_all), ("full step, compiled", step), ("target features only, compiled", target_only)]
    for name, fn in runs:
        if name == "compile":
            fn()
            continue
        t_warm = time.perf_counter()
        for _ in range(5):
            fn()
        sync()
        print(f"{name}: warm-up (5 steps) {time.perf_counter() - t_warm:.1f} s", flush=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            fn()
        sync()
        ms = 1e3 * (time.perf_counter() - t0) / args.steps
        lines.append(f"{name}: {ms:.1f} ms per step (batch {B} x {T}, {A} anchors, k {dcfg.block_size}, "
                     f"{dcfg.num_layers} layer(s), target layers {dcfg.target_layer_ids})")
        print(lines[-1], flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            step()
        sync()
    by = "cuda" if cuda else "cpu"
    table = prof.key_averages().table(sort_by=f"self_{by}_time_total", row_limit=30)
    ops = prof.key_averages().table(sort_by=f"{by}_time_total", row_limit=40)
    print(table[:6000], flush=True)
    (out_dir / "drafter_train_profile.txt").write_text("\n".join(lines) + "\n\n---- kernels (5 steps)\n" + table
                                                       + "\n\n---- ops by total CUDA time (5 steps)\n" + ops)


if __name__ == "__main__":
    main()
