"""`adaspec train drafter`: train a DSpark drafter against a frozen target.

Target features and distributions are computed online for every batch (no offline cache).
Each sequence gives --anchors-per-seq random anchors, all blocks in one batched forward.
AdamW (fused on CUDA), 4% warmup then cosine to 0, weight decay 0, grad clip 1.0, bf16 autocast on CUDA.
OUT/checkpoint.pt makes the run resumable (--resume); the result is a drafter directory
(config.json + model.safetensors) in OUT.

Data: --corpus DIR (the train helper's corpus; packed train split), --data FILE (.npy
[N, L] token ids), or --self-distill: continuations of corpus prefixes sampled from the
target itself (OUT/selfdistill.npy, reused on --resume), which match what the drafter
will have to predict at serving time.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from adaspec.errors import AdaspecError


def add_subparser(sub) -> None:
    p = sub.add_parser("drafter", help="train a DSpark drafter for a target model")
    p.add_argument("--target", required=True, help="target model directory or embedded name")
    src = p.add_argument_group("data")
    src.add_argument("--corpus", type=Path, help="corpus directory (train split; prompts for --self-distill)")
    src.add_argument("--data", type=Path, help=".npy [N, L] token sequences to train on")
    src.add_argument("--self-distill", action="store_true", help="train on target-sampled continuations of corpus prefixes")
    src.add_argument("--sd-num-seqs", type=int, default=2048)
    src.add_argument("--sd-prompt-len", type=int, default=32)
    src.add_argument("--sd-temperature", type=float, default=1.0)
    src.add_argument("--sd-greedy-frac", type=float, default=0.25, help="share of self-distilled rows decoded greedily")
    src.add_argument("--sd-batch", type=int, default=256)
    src.add_argument("--sd-profile-steps", type=int, default=0,
                     help="profile this many of the self-distillation's decode steps (from the 100th, or halfway) "
                          "and write OUT/selfdistill_profile/step_profile.json: where a step's time goes")
    src.add_argument("--corpus-frac", type=float, default=0.0,
                     help="with --self-distill or --data, and --corpus: share of each batch taken from corpus text")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--target-layers", type=str, default=None, help="comma-separated target layer ids (default: spread)")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's <|mask|>")
    p.add_argument("--init", choices=["target", "random"], default="target",
                   help="target: drafter layers start as copies of the target's last layers and fc as the "
                        "identity on the deepest chosen layer (converges faster); random: Normal(0, 0.02)")
    p.add_argument("--anchors-per-seq", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of --steps")
    p.add_argument("--gamma", type=float, default=4.0, help="slot weight decay w_j = exp(-(j-1)/gamma)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--heldout-rows", type=int, default=0,
                   help="hold out the last N rows of the sequences (--data or the self-distilled ones) from training "
                        "and log the loss and soft acceptance per slot on them and on N fixed training rows (a "
                        "multiple of --batch-size): whether the drafter learns the target or memorizes its rows")
    p.add_argument("--heldout-every", type=int, default=500,
                   help="with --heldout-rows: at logged steps that are multiples of this, and at the last step")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the frozen target's layers (its features are most of a step's time) and the "
                        "loss; falls back to eager if the compiler fails")
    p.add_argument("--compile-drafter", action="store_true",
                   help="with --compile: also torch.compile the drafter's training pass (its layers over the context "
                        "and the blocks, forward and backward), which eager is hundreds of small kernels a step, each "
                        "launched from Python")
    p.add_argument("--adamw-impl", choices=["auto", "fused", "foreach"], default="auto",
                   help="AdamW's kernels: fused (one launch for all parameters) or foreach (multi-tensor, a few "
                        "launches per group of tensors); auto: fused on CUDA (as the target's training), foreach "
                        "elsewhere")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many training steps with torch.profiler (from step 50, or halfway through "
                        "a shorter run) and write OUT/step_profile.json and .txt: where a step's time goes")
    p.add_argument("--cache-target-features", action="store_true",
                   help="compute the frozen target's features of the --data / self-distilled rows once and keep them "
                        "on the device, instead of running the target over those rows at every step (they repeat "
                        "every epoch; corpus rows of a mixed batch still run it). Needs rows one --seq-len long; "
                        "costs rows x seq_len x (target layers + 1) x hidden x 2 bytes (bf16): without that much "
                        "free device memory training goes on without the cache, with a note")
    p.add_argument("--cuda-graph-step", action="store_true",
                   help="on CUDA, after a few ordinary steps replay the whole training step (features, forward, loss, "
                        "backward, clipping, AdamW) as one captured CUDA graph: the same kernels without the host's "
                        "launches between them (train/captured_step.py); a capture that fails trains on as before")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock budget for the optimization: --steps is lowered to fit after a short probe "
                        "and fitted again every 100 steps (the cosine schedule follows the total)")
    p.set_defaults(func=run)


def _mask_token_id(target_dir: Path, vocab: int, explicit: int | None) -> int:
    if explicit is not None:
        return explicit
    try:
        from adaspec.models.tokenizer import Tokenizer

        tid = Tokenizer.from_dir(target_dir).token_to_id("<|mask|>")
    except Exception:
        tid = None
    if tid is None:
        raise AdaspecError("the target's tokenizer has no <|mask|> token; pass --mask-token-id")
    if tid >= vocab:
        raise AdaspecError(f"<|mask|> id {tid} is outside the target's vocabulary ({vocab})")
    return tid


def init_drafter(drafter, target, seed: int, from_target: bool = False) -> None:
    """Normal(0, 0.02) projections, unit norms, zero Markov bias, target's embedding/LM head.
    from_target: decoder layers copied from the target's last layers, fc = identity on the
    deepest chosen target layer, so the drafter starts close to "one more target layer"."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name in ("markov_head.markov_w2.weight", "confidence_head.proj.bias"):
                p.zero_()  # start as "no bigram bias", confidence 0.5
            elif p.requires_grad:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        drafter.copy_from_target(target)
        if from_target:
            n, src = len(drafter.layers), target.model.layers
            for i, layer in enumerate(drafter.layers):
                layer.load_state_dict(src[max(0, len(src) - n + i)].state_dict())
            d = drafter.config.base.hidden_size
            deepest = max(range(len(drafter.config.target_layer_ids)), key=lambda i: drafter.config.target_layer_ids[i])
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, deepest * d:(deepest + 1) * d] = torch.eye(d)


def _compile(target, loss_fn):
    """torch.compile each layer of the frozen target (one graph for all: the layers are alike, the
    batch shape fixed) and the loss. On the H200 the eager target took 47 of a step's 74 ms for the
    code-0.6b preset, mostly unfused elementwise work (BENCHMARKS.md, run 11). -> (loss, compiled)."""
    import sys

    import torch

    from adaspec.train.target import _uncompile_layers

    try:
        for layer in target.model.layers:
            # static shapes: with --cache-target-features the target runs at two batch shapes (the
            # cache's chunks, a mixed batch's corpus rows), each its own graph, not a dynamic one
            layer.compile(dynamic=False)
        return torch.compile(loss_fn), True
    except Exception as e:  # noqa: BLE001 - any backend problem: train eagerly instead
        _uncompile_layers(target)
        print(f"torch.compile unavailable ({e}); training eagerly", file=sys.stderr)
        return loss_fn, False


def compile_drafter_training(drafter) -> None:
    """torch.compile the drafter's training pass (``forward_train``; the batch has one shape). Eager
    it is hundreds of small kernels forward and backward (norms, rope, autocast casts), each launched
    from Python, and the H200's host is slow enough that the drafter's steps wait on it (H200 runs
    28-31: 56-70 ms a step for 47-48 ms of kernels). Undone by ``uncompile_drafter_training``."""
    import torch

    drafter.forward_train = torch.compile(drafter.forward_train)  # an instance attribute over the method


def uncompile_drafter_training(drafter) -> None:
    drafter.__dict__.pop("forward_train", None)


def graph_step_mode(args, device) -> str | None:
    """"cuda" where --cuda-graph-step applies (on CUDA), else None. ("eager": the captured step's
    buffers and replays run eagerly, for CPU tests of the loop; never from the command line.)"""
    return "cuda" if getattr(args, "cuda_graph_step", False) and device.type == "cuda" else None


def drafter_optimizer(params, lr: float, device, impl: str = "auto", capturable: bool = False):
    """AdamW (betas 0.9 / 0.95, no weight decay); impl as --adamw-impl. capturable: its step
    count and learning rate live on the device (a CUDA graph replays it; set_lr updates the rate)."""
    import torch

    if impl not in ("auto", "fused", "foreach"):
        raise AdaspecError(f"unknown AdamW implementation {impl!r}; use auto, fused or foreach")
    fused = impl == "fused" or (impl == "auto" and device.type == "cuda")
    kernels = {"fused": True} if fused else {"foreach": True} if impl == "foreach" else {}
    if capturable:
        kernels["capturable"] = True
        lr = torch.tensor(lr, dtype=torch.float32, device=device)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, **kernels)


def load_optimizer_state(opt, state: dict) -> None:
    """opt.load_state_dict(state), keeping this run's AdamW implementation: loading replaces each
    group with the saved one, its capturable / fused / foreach flags and its rate included, so a
    checkpoint of a run without --cuda-graph-step would make this run's optimizer uncapturable
    (its capture then fails) and one with it would leave a host tensor as the rate."""
    import torch

    mine = [{k: g.get(k) for k in ("capturable", "fused", "foreach")} for g in opt.param_groups]
    rates = [g["lr"] for g in opt.param_groups]
    opt.load_state_dict(state)
    for group, flags, rate in zip(opt.param_groups, mine, rates):
        group.update(flags)
        if isinstance(rate, torch.Tensor):  # this run's rate is a device tensor (set_lr writes it)
            group["lr"] = rate
        elif isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])


def set_lr(opt, lr: float) -> None:
    """The learning rate of every group: written into the device tensor of a capturable
    optimizer (which a captured step reads), else replaced."""
    import torch

    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def forward_backward(target, drafter, loss_fn, amp, ids, anchors, gamma: float, features=None):
    """One batch through the frozen target (unless its features are given) and the drafter, the
    loss, its gradients -> (loss, stats)."""
    from adaspec.train.drafter_loss import block_forward

    with amp:
        bb = block_forward(target, drafter, ids, anchors, features)
    loss, stats = loss_fn(bb, gamma=gamma)
    loss.backward()
    return loss, stats


def _build_sampler(args, target_dir: Path, out: Path, target, device):
    """-> (the training batches' sampler, the held-out row sets or None: see split_heldout)."""
    import numpy as np

    from adaspec.train.drafter_data import MixedSampler, RowSampler, StreamSampler, corpus_tokens, load_sequences

    if args.data and not (args.corpus and args.corpus_frac > 0):
        rows, heldout = split_heldout(load_sequences(args.data), args)
        return RowSampler(rows, args.seq_len, args.batch_size, args.seed), heldout
    if not args.corpus:
        raise AdaspecError("give --corpus DIR (with or without --self-distill) or --data FILE")
    tokens = corpus_tokens(args.corpus, target_dir)
    if not args.self_distill and not args.data:
        if args.heldout_rows:
            raise AdaspecError("--heldout-rows holds out rows of --data or of the self-distilled sequences; "
                               "this run trains on corpus text only")
        return StreamSampler(tokens, args.seq_len, args.batch_size, args.seed), None
    if args.data:  # sequences made elsewhere (e.g. `adaspec train pair`'s self-distill stage)
        rows = load_sequences(args.data)
    else:
        path = out / "selfdistill.npy"
        if not (args.resume and path.is_file()):
            np.save(path, self_distill_rows(target, tokens, args, device, sd_profile(args, device, out)))
        rows = np.load(path)
    rows, heldout = split_heldout(rows, args)
    n_corpus = int(round(args.batch_size * args.corpus_frac))
    sd = RowSampler(rows, args.seq_len, args.batch_size - n_corpus, args.seed)
    if n_corpus == 0:
        return sd, heldout
    return MixedSampler(sd, StreamSampler(tokens, sd.seq_len, n_corpus, args.seed + 1)), heldout


def split_heldout(rows, args):
    """--heldout-rows N: the last N rows leave training -> (training rows, {"heldout": the N rows,
    "train_rows": the N training rows just before them}, each cropped to its first --seq-len
    tokens), else (rows, None). The two sets are measured alike and are of one kind (the
    self-distilled rows run greedy first, sampled last, and the pair's sampled part holds far
    more than 2N rows; the first rows would be greedy text, easier to draft whether memorized or
    not), so their gap is memorization, not the mix of a training batch or another domain."""
    import torch

    n = args.heldout_rows
    if not n:
        return rows, None
    if args.heldout_every < 1:
        raise AdaspecError(f"--heldout-every {args.heldout_every}: give a number of steps, at least 1")
    if n < 0 or n % args.batch_size:
        raise AdaspecError(f"--heldout-rows {n}: give a positive multiple of --batch-size {args.batch_size} (the "
                           "held-out pass runs the training batch's shape, so nothing is compiled again)")
    if rows.shape[0] < 2 * n + 1:
        raise AdaspecError(f"--heldout-rows {n}: the sequences hold {rows.shape[0]} rows; holding out {n} needs "
                           f"more than {2 * n} (as many again are measured as training rows)")
    if rows.shape[1] < args.seq_len:
        raise AdaspecError(f"--heldout-rows: the sequences' rows hold {rows.shape[1]} tokens, fewer than --seq-len "
                           f"{args.seq_len}")
    as_tensor = lambda a: torch.from_numpy(a[:, :args.seq_len].astype("int64"))  # noqa: E731
    return rows[:-n], {"heldout": as_tensor(rows[-n:]), "train_rows": as_tensor(rows[-2 * n:-n])}


def heldout_stats(target, drafter, loss_fn, amp, sets: dict, anchors: dict, gamma: float, batch: int, device) -> dict:
    """Loss and soft acceptance per slot (1 - TV, as the training log's) on each fixed row set, in
    chunks of the training batch's shape and with gradients enabled as in training, so that no
    compiled graph is traced again (a guard on either would recompile); nothing is updated."""
    from adaspec.h2d import to_device
    from adaspec.train.drafter_loss import block_forward, float_stats

    out = {}
    for name, rows in sets.items():
        losses, accepts = [], []
        for i in range(0, rows.shape[0], batch):
            ids, anc = to_device(rows[i:i + batch], device), to_device(anchors[name][i:i + batch], device)
            with amp:
                bb = block_forward(target, drafter, ids, anc)
            loss, stats = loss_fn(bb, gamma=gamma)
            losses.append(loss.item())
            accepts.append(float_stats(stats)["accept"])
        out[name] = {"loss": round(sum(losses) / len(losses), 4),
                     "accept": [round(sum(a[j] for a in accepts) / len(accepts), 4) for j in range(len(accepts[0]))]}
    return out


def _row_sampler(sampler):
    """The sampler of the rows a feature cache holds: the first part of a mixed batch, or the whole."""
    from adaspec.train.drafter_data import MixedSampler

    return sampler.parts[0] if isinstance(sampler, MixedSampler) else sampler


def build_feature_cache(args, target, sampler, layer_ids: list[int], amp, device):
    """--cache-target-features: the cache of the sampler's rows (train/feature_cache.py), or None
    (with a note) when the device lacks the memory for it."""
    import torch

    from adaspec.train.drafter_data import RowSampler
    from adaspec.train.feature_cache import TargetFeatureCache, cache_bytes

    rows = _row_sampler(sampler)
    if not isinstance(rows, RowSampler):
        raise AdaspecError("--cache-target-features caches the rows of --data or --self-distill; this run trains "
                           "on corpus windows only")
    N, L = rows.rows.shape
    if L != rows.seq_len:
        raise AdaspecError(f"--cache-target-features: the rows hold {L} tokens, more than --seq-len {rows.seq_len}: "
                           "training windows start inside them and would not match the cached rows' features")
    need = cache_bytes(N, L, target.config.hidden_size, len(layer_ids), next(target.parameters()).dtype)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if need > 0.6 * free:  # the training step's own tensors need the rest
            print(f"--cache-target-features: {need / 2**30:.1f} GiB for {N} rows against {free / 2**30:.1f} GiB "
                  "free on the device; training without the cache", flush=True)
            return None
    t0 = time.time()
    cache = TargetFeatureCache.build(target, rows.rows, layer_ids, amp, args.batch_size)
    print(f"cached the target's features of {N} rows x {L} tokens ({need / 2**30:.2f} GiB) in "
          f"{time.time() - t0:.1f} s", flush=True)
    return cache


def cached_rows(cache, sampler, seq_len: int):
    """The cache rows of the batch just drawn, on the device (its windows checked: train/feature_cache.py)."""
    rows, starts = _row_sampler(sampler).last_draw
    return cache.rows_on_device(rows, starts, seq_len)


def batch_features(cache, target, rows, ids, layer_ids: list[int], amp):
    """The batch's target features: the cached rows' (rows: their indices, on the device) gathered,
    the rest (a mixed batch's corpus windows, after them in the batch) computed."""
    import torch

    from adaspec.train.drafter_loss import target_features

    hidden, feats = cache.take(rows)
    n = hidden.shape[0]
    if ids.shape[0] > n:
        with torch.no_grad(), amp:
            h, f = target_features(target, ids[n:], layer_ids)
        hidden, feats = torch.cat([hidden, h.to(hidden.dtype)]), torch.cat([feats, f.to(feats.dtype)])
    return hidden, feats


def sd_profile(args, device, out_dir: Path):
    """The StepProfile of the self-distillation's decode steps (--sd-profile-steps; idle at 0).
    device: a torch.device."""
    from adaspec.train.step_profile import StepProfile

    gen_len = args.seq_len - args.sd_prompt_len
    return StepProfile(args.sd_profile_steps, min(100, gen_len // 2), device, Path(out_dir) / "selfdistill_profile")


def self_distill_rows(target, tokens, args, device, profile=None):
    """profile: a StepProfile of the decode steps (the sampled rows' batch when there are any)."""
    import numpy as np
    import torch

    from adaspec.train.drafter_data import prompt_windows
    from adaspec.train.self_distill import sample_continuations

    gen_len = args.seq_len - args.sd_prompt_len
    if gen_len < args.block_size + 1:
        raise AdaspecError("--seq-len must exceed --sd-prompt-len by more than the block size")
    prompts = prompt_windows(tokens, args.sd_num_seqs, args.sd_prompt_len, args.seed).to(device)
    n_greedy = int(round(args.sd_num_seqs * args.sd_greedy_frac))
    t0 = time.time()
    parts = []
    if n_greedy:
        parts.append(sample_continuations(target, prompts[:n_greedy], gen_len, 0.0, seed=args.seed,
                                          batch_size=args.sd_batch, progress=True,
                                          profile=profile if n_greedy == len(prompts) else None))
    if n_greedy < len(prompts):
        parts.append(sample_continuations(target, prompts[n_greedy:], gen_len, args.sd_temperature,
                                          seed=args.seed + 1, batch_size=args.sd_batch, progress=True, profile=profile))
    rows = torch.cat(parts).numpy()
    print(f"self-distill: {rows.shape[0]} sequences x {rows.shape[1]} tokens in {time.time() - t0:.1f}s", flush=True)
    dtype = np.uint16 if target.config.vocab_size <= 65536 else np.int32
    return rows.astype(dtype)


def run(args) -> int:
    if args.compile_drafter and not args.compile:
        raise AdaspecError("--compile-drafter compiles on top of --compile: give both")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise AdaspecError(f"--max-minutes {args.max_minutes}: give a positive number of minutes (or leave it out: "
                           "--steps alone)")
    import torch
    from tqdm import tqdm

    from adaspec.h2d import to_device
    from adaspec.models.drafter import DrafterConfig, DSparkDrafter, save_drafter
    from adaspec.models.loader import load_target, model_dir
    from adaspec.train.drafter_loss import cosine_lr, dspark_loss, float_stats, sample_anchors
    from adaspec.train.step_profile import StepProfile, format_summary
    from adaspec.train.captured_step import WARM_STEPS, capture_step
    from adaspec.train.time_box import StepTimeBox
    from adaspec.train.target import _uncompile_layers

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)
    target_dir = model_dir(args.target)
    target, tcfg = load_target(target_dir, dtype="bfloat16" if device.type == "cuda" else "float32", device=device)
    for p in target.parameters():
        p.requires_grad_(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False) if args.resume and ckpt_path.is_file() else None

    if ckpt is not None:
        cfg = DrafterConfig.from_hf(ckpt["config"])
    else:
        layers = [int(x) for x in args.target_layers.split(",")] if args.target_layers else None
        cfg = DrafterConfig.from_target(
            tcfg, mask_token_id=_mask_token_id(target_dir, tcfg.vocab_size, args.mask_token_id),
            block_size=args.block_size, num_layers=args.layers, markov_rank=args.markov_rank, target_layer_ids=layers,
        )
    cfg.check_target(tcfg)
    drafter = DSparkDrafter(cfg)
    init_drafter(drafter, target, args.seed, from_target=args.init == "target")
    drafter.to(device)
    drafter.rope.build_tables(device=device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    graph_step = graph_step_mode(args, device)
    opt = drafter_optimizer(params, args.lr, device, args.adamw_impl, capturable=graph_step == "cuda")
    sampler, heldout = _build_sampler(args, target_dir, out, target, device)
    anchor_gen = torch.Generator().manual_seed(args.seed + 7)
    if heldout:  # the same anchors at every measurement
        g = torch.Generator().manual_seed(args.seed + 11)
        heldout_anchors = {k: sample_anchors(v.shape[0], v.shape[1], cfg.block_size, args.anchors_per_seq, g)
                           for k, v in heldout.items()}
    step = 0
    if ckpt is not None:
        drafter.load_state_dict(ckpt["model"], strict=False)
        load_optimizer_state(opt, ckpt["optim"])
        sampler.set_state(ckpt["sampler_rng"])
        anchor_gen.set_state(ckpt["anchor_rng"])
        step = ckpt["step"]
        print(f"resumed from step {step}", flush=True)

    def save_ckpt():
        trainable = {k: v for k, v in drafter.state_dict().items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        torch.save({"step": step, "model": trainable, "optim": opt.state_dict(), "config": cfg.to_hf(),
                    "sampler_rng": sampler.get_state(), "anchor_rng": anchor_gen.get_state(), "args": vars(args)},
                   ckpt_path.with_suffix(".tmp"))
        ckpt_path.with_suffix(".tmp").replace(ckpt_path)

    loss_fn, compiled = dspark_loss, False
    if args.compile:  # after the sampler: self-distillation runs the target at other shapes
        loss_fn, compiled = _compile(target, dspark_loss)
        if compiled and args.compile_drafter:
            compile_drafter_training(drafter)
    n_train = sum(p.numel() for p in params)
    print(f"drafter: {cfg.num_layers} layer(s), k={cfg.block_size}, rank {cfg.markov_rank}, target layers "
          f"{cfg.target_layer_ids}, {n_train / 1e6:.2f}M trainable params; device {device}", flush=True)
    # a captured step needs autocast without its cache of cast weights (the cache lives across a
    # capture's end); the ordinary steps before it run the same way, so every step is alike
    amp = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=graph_step != "cuda") if device.type == "cuda"
           else torch.autocast("cpu", enabled=False))
    def train_eagerly(e: Exception) -> None:
        """A compiler failure: the target, the loss and the drafter's pass run eagerly from now on."""
        nonlocal loss_fn, compiled
        tqdm.write(f"compiled step failed ({type(e).__name__}: {e}); training eagerly")
        loss_fn, compiled = dspark_loss, False
        _uncompile_layers(target)
        uncompile_drafter_training(drafter)

    def train_step(ids, anchors, rows=None):
        """One optimizer step on a batch already on the device (rows: its cached rows' indices).
        Reads nothing back, so it can be captured (train/captured_step.py)."""
        features = batch_features(cache, target, rows, ids, cfg.target_layer_ids, amp) if cache is not None else None
        loss, stats = forward_backward(target, drafter, loss_fn, amp, ids, anchors, args.gamma, features)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        # detached: a loss kept with its autograd graph keeps the parameters' AccumulateGrad nodes
        # alive, on the stream of the step that made them, and a capture's backward then waits on
        # that stream, which invalidates the capture (cudaErrorStreamCaptureInvalidated, PyTorch's
        # "AccumulateGrad node's stream does not match" warning; H200, the first GPU test)
        return loss.detach(), stats

    cache = None
    if args.cache_target_features:  # after the compile: built in training-batch chunks, the target's shape
        try:
            cache = build_feature_cache(args, target, sampler, cfg.target_layer_ids, amp, device)
        except AdaspecError:
            raise
        except Exception as e:  # noqa: BLE001 - a compiler failure in the target's first compiled forward
            if not compiled:
                raise
            train_eagerly(e)
            cache = build_feature_cache(args, target, sampler, cfg.target_layer_ids, amp, device)
    history = []
    captured = None  # the CapturedStep once the step is replayed as a graph; False: not (any more)
    capture_at = step + WARM_STEPS if graph_step else None
    loop_stream = contextlib.ExitStack()
    if graph_step == "cuda":
        # every step on one side stream, the capture too: nodes autograd makes in the ordinary
        # steps are on the stream the capture records (PyTorch's recipe warms up on a side stream)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        loop_stream.enter_context(torch.cuda.stream(side))
    bar = tqdm(total=args.steps, initial=step, desc="train drafter", unit="step")
    t0 = time.time()
    # time box (train/time_box.py): the step count is fitted to --max-minutes after 10 warmup steps
    # and 30 timed ones, then fitted again every 100 steps from the mean step time so far
    box = None
    if args.max_minutes:
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        box = StepTimeBox(args.max_minutes * 60, step, args.steps, sync=sync)
    shown = None
    # after the time box's first fit, so that neither times the other
    profile = StepProfile(args.profile_steps, max(step, min(50, args.steps // 2)), device, out)
    drafter.train()
    try:
        while step < args.steps:
            profile.maybe_start(step)
            if box is not None and box.fit(step) != args.steps:
                args.steps = bar.total = box.total
                if shown is None or abs(args.steps - shown) > 0.02 * shown:  # say the first fit and large moves
                    shown = args.steps
                    tqdm.write(f"--max-minutes {args.max_minutes}: {box.fits[-1][1] * 1000:.0f} ms/step at step {step}, "
                               f"training {args.steps} steps")
            # pinned, asynchronous copies: a pageable one waits for the stream, so the host could never
            # run ahead of the GPU (H200 run 28: 70 ms wall per step against 47.5 ms of kernels)
            ids = to_device(sampler.next(), device)
            anchors = to_device(sample_anchors(ids.shape[0], ids.shape[1], cfg.block_size, args.anchors_per_seq,
                                               anchor_gen), device)
            lr = cosine_lr(step, args.steps, args.lr, args.warmup)
            set_lr(opt, lr)
            inputs = {"ids": ids, "anchors": anchors}
            if cache is not None:
                inputs["rows"] = cached_rows(cache, sampler, ids.shape[1])
            if step == capture_at and captured is None:
                captured = capture_step(train_step, inputs, opt, eager=graph_step == "eager")
            if captured:
                captured.load(**inputs)
                loss, stats = captured.replay()
            else:
                opt.zero_grad(set_to_none=True)
                try:
                    loss, stats = train_step(**inputs)
                except Exception as e:  # noqa: BLE001 - a compiler failure: redo this step eagerly
                    if not compiled:
                        raise
                    train_eagerly(e)
                    opt.zero_grad(set_to_none=True)
                    loss, stats = train_step(**inputs)
            step += 1
            bar.update(1)
            if profile.maybe_stop(step) is not None:
                tqdm.write(format_summary(profile.summary))
            if step % args.log_every == 0 or step == args.steps:
                stats = float_stats(stats)
                rec = {"step": step, "loss": loss.item(), "lr": lr, "time_s": round(time.time() - t0, 1), **stats}
                if heldout and (step % args.heldout_every == 0 or step == args.steps):
                    rec.update(heldout_stats(target, drafter, loss_fn, amp, heldout, heldout_anchors, args.gamma,
                                             args.batch_size, device))
                history.append(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", ce=f"{stats['ce']:.2f}", acc1=f"{stats['accept'][0]:.2f}")
                tqdm.write(json.dumps({k: (round(v, 4) if isinstance(v, float) else [round(x, 3) for x in v]
                                           if isinstance(v, list) else v) for k, v in rec.items()}))
            if args.save_every and step % args.save_every == 0 and step < args.steps:
                save_ckpt()
    finally:  # (an exception too: the caller gets its stream back, the graph is freed)
        bar.close()
        loop_stream.close()
        if graph_step == "cuda":  # the default stream waits for the side stream's work
            torch.cuda.current_stream(device).wait_stream(side)
        if captured:
            captured.release()
    save_ckpt()
    drafter.eval()
    save_drafter(drafter, cfg, out, dtype=getattr(torch, args.save_dtype))
    log = out / "train_log.jsonl"
    with open(log, "a") as f:
        for rec in history:
            f.write(json.dumps(rec) + "\n")
    print(f"saved drafter to {out} ({step} steps, {time.time() - t0:.0f}s)", flush=True)
    return 0
