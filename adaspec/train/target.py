"""`adaspec train target`: pretrain a Qwen3-architecture target model on a corpus.

Recipe: packed sequences (documents joined by EOS, random windows), AdamW (betas 0.9/0.95,
weight decay on matrices only), linear warmup then cosine decay to ``--min-lr-ratio`` x lr,
gradient clipping, bf16 autocast on CUDA and float32 on CPU. Validation loss every
``--eval-every`` steps; the weights with the best validation loss are the ones written (the
final ones unless the run overfits). ``OUT/checkpoint.pt`` (model, optimizer, step, RNG
states) is written at each evaluation; ``--resume`` continues from it.

OUT becomes a Hugging Face model directory: config.json, model.safetensors, tokenizer files,
generation_config.json, plus train_stats.json with the run's figures.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from adaspec.commands.options import at_least
from adaspec.errors import AdaspecError


def add_subparser(sub) -> None:
    p = sub.add_parser("target", help="train a Qwen3-architecture target model", description=__doc__)
    p.add_argument("--corpus", type=Path, required=True, help="directory from `adaspec train corpus`")
    p.add_argument("--tokenizer", type=Path, required=True, help="directory from `adaspec train tokenizer`")
    p.add_argument("--out", type=Path, required=True, help="output model directory")
    g = p.add_argument_group("model shape")
    g.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    g.add_argument("--layers", type=at_least(1), default=6)
    g.add_argument("--hidden", type=at_least(1), default=256)
    g.add_argument("--heads", type=at_least(1), default=4)
    g.add_argument("--kv-heads", type=at_least(1), default=2)
    g.add_argument("--head-dim", type=at_least(1), default=64)
    g.add_argument("--intermediate", type=at_least(1), default=768)
    g.add_argument("--max-position", type=at_least(1), default=2048)
    g.add_argument("--rope-theta", type=float, default=10000.0)
    g.add_argument("--untied", action="store_true", help="separate lm_head (default: tied to embeddings)")
    o = p.add_argument_group("optimization")
    o.add_argument("--seq-len", type=at_least(1), default=512)
    o.add_argument("--batch-size", type=at_least(1), default=64)
    o.add_argument("--lr", type=float, default=2e-3)
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--warmup", type=at_least(0), default=200, help="warmup steps")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--grad-clip", type=float, default=1.0)
    length = o.add_mutually_exclusive_group()
    length.add_argument("--steps", type=at_least(1), help="optimizer steps (default 2000)")
    length.add_argument("--tokens", type=float, help="training tokens; steps = tokens / (batch x seq-len)")
    o.add_argument("--time-budget", type=float,
                   help="seconds: after measuring step time, cut the step count so the run fits (schedule included)")
    r = p.add_argument_group("run")
    r.add_argument("--eval-every", type=int, default=250)
    r.add_argument("--eval-tokens", type=int, default=262144, help="validation tokens per evaluation")
    r.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    r.add_argument("--compile", action="store_true", help="torch.compile the training step (falls back to eager)")
    r.add_argument("--compile-mode", choices=["model", "layers"], default="model",
                   help="model: the whole loss in one graph; layers: each decoder layer compiled, all layers sharing "
                        "one graph (compile time of one layer, not of the whole depth: for deep models)")
    r.add_argument("--checkpoint-every", type=int, default=None, metavar="EVALS",
                   help="write OUT/checkpoint.pt every N evaluations (default 1); 0: never (no --resume, no "
                        "multi-GB writes of optimizer state for large models)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    r.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    r.add_argument("--threads", type=int, help="CPU threads for torch")
    r.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many training steps with torch.profiler (from step 60, after the time budget's "
                        "probe, or halfway through a shorter run) and write OUT/step_profile/step_profile.json and "
                        ".txt: where a step's time goes")
    p.set_defaults(func=_run)


def _run(args) -> int:
    stats = train_target(args)
    print(
        f"done: {stats['params'] / 1e6:.2f}M params, {stats['tokens_seen'] / 1e6:.1f}M tokens, "
        f"val loss {stats['val_loss']:.4f} (ppl {stats['val_ppl']:.2f}), {stats['wall_time_s']:.0f}s -> {args.out}"
    )
    return 0


def build_config(args, vocab_size: int, eos_id: int):
    from adaspec.models.config import ModelConfig

    if args.heads * args.head_dim <= 0 or args.heads % args.kv_heads:
        raise AdaspecError("--heads must be a positive multiple of --kv-heads")
    if args.seq_len > args.max_position:
        raise AdaspecError(f"--seq-len {args.seq_len} exceeds --max-position {args.max_position}")
    return ModelConfig(
        architecture=args.arch, vocab_size=vocab_size, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        rms_norm_eps=1e-6, rope_theta=args.rope_theta, max_position_embeddings=args.max_position,
        tie_word_embeddings=not args.untied, bos_token_id=eos_id, eos_token_id=eos_id,
    )


def init_weights(model, num_layers: int, std: float = 0.02) -> None:
    """Normal(0, std) for matrices, residual output projections scaled by 1/sqrt(2 x layers)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                scale = 1 / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.normal_(0.0, std * scale)
            elif name.endswith("bias"):
                p.zero_()


def lr_at(step: int, args, total_steps: int) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def count_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def make_loss_fn(model):
    """loss(x, y) = mean next-token cross-entropy; the unit that --compile compiles."""
    import torch.nn.functional as F

    def loss_fn(x, y):
        logits = model.compute_logits(model.forward_dense(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))

    return loss_fn


def evaluate(loss_fn, windows, batch_size: int, device, autocast) -> float:
    import torch

    x_all, y_all = windows
    total, n = 0.0, 0
    with torch.no_grad(), autocast():
        for i in range(0, x_all.shape[0], batch_size):
            x = x_all[i:i + batch_size].to(device, non_blocking=True)
            y = y_all[i:i + batch_size].to(device, non_blocking=True)
            total += float(loss_fn(x, y)) * x.shape[0]
            n += x.shape[0]
    return total / n


def _pick_device(name: str):
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise AdaspecError("--device cuda asked for, but torch sees no CUDA device")
    return torch.device(name)


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _save_checkpoint(path: Path, state: dict) -> None:
    import torch

    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _uncompile_layers(model) -> None:
    """Undo ``layer.compile()`` (nn.Module keeps the compiled callable in ``_compiled_call_impl``)."""
    for layer in model.model.layers:
        if getattr(layer, "_compiled_call_impl", None) is not None:
            layer._compiled_call_impl = None


def train_target(args) -> dict:
    import torch

    threads = torch.get_num_threads()
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)  # --threads is for this run only


def _train(args) -> dict:
    import contextlib

    import torch
    from tqdm import tqdm

    from adaspec.models.loader import save_pretrained
    from adaspec.models.target import TargetModel
    from adaspec.train.data import PackedSampler, eval_windows, load_tokens
    from adaspec.train.step_profile import StepProfile, format_summary
    from adaspec.train.tokenizer import EOS, copy_tokenizer_files, load_raw

    t_start = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _pick_device(args.device)
    tok = load_raw(args.tokenizer)
    eos_id = tok.token_to_id(EOS)
    if eos_id is None:
        raise AdaspecError(f"tokenizer in {args.tokenizer} has no {EOS} token")
    cfg = build_config(args, tok.get_vocab_size(), eos_id)
    data = load_tokens(args.corpus, args.tokenizer, splits=("train", "val"))
    tokens_per_step = args.batch_size * args.seq_len
    if args.steps:
        total_steps = args.steps
    elif args.tokens:
        total_steps = max(1, int(args.tokens // tokens_per_step))
    else:
        total_steps = 2000

    torch.manual_seed(args.seed)
    model = TargetModel(cfg)
    init_weights(model, cfg.num_hidden_layers)
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt_kwargs = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **opt_kwargs,
    )
    sampler = PackedSampler(data["train"], args.seq_len, args.batch_size, seed=args.seed, device=device)
    val_windows = eval_windows(data["val"], args.seq_len, args.eval_tokens)
    train_windows = eval_windows(data["train"], args.seq_len, args.eval_tokens)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    history: list[dict] = []
    ck: dict = {}
    best = {"val_loss": float("inf"), "step": -1, "state": None}
    budget_fixed = args.time_budget is None
    if args.resume and ckpt_path.is_file():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ck["model_config"] != cfg.to_hf():
            raise AdaspecError(f"{ckpt_path} was made for another model shape; drop --resume or change --out")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sampler.gen.set_state(ck["sampler_rng"])
        torch.set_rng_state(ck["torch_rng"])
        step, tokens_seen = ck["step"], ck["tokens_seen"]
        if args.time_budget is not None or not (args.steps or args.tokens):
            total_steps = ck["total_steps"]  # keep the schedule the run started with
        history, elapsed_before, budget_fixed = ck["history"], ck["elapsed_s"], True
        best = {"val_loss": ck["best_val_loss"], "step": ck["best_step"], "state": ck.get("best_state")}
        print(f"resumed from {ckpt_path} at step {step}/{total_steps}", file=sys.stderr)
    elif args.resume:
        print(f"--resume: no {ckpt_path} yet, starting fresh", file=sys.stderr)

    raw_loss = make_loss_fn(model)
    loss_fn = raw_loss
    compiled = False
    if args.compile:
        try:
            if getattr(args, "compile_mode", "model") == "layers":
                for layer in model.model.layers:
                    layer.compile()
            else:
                loss_fn = torch.compile(raw_loss)
            compiled = True
        except Exception as e:  # noqa: BLE001 - any backend problem: train eagerly instead
            _uncompile_layers(model)
            print(f"torch.compile unavailable ({e}); training eagerly", file=sys.stderr)

    def run_eval(at_step: int) -> dict:
        model.eval()
        v = evaluate(raw_loss, val_windows, args.batch_size, device, autocast)
        model.train()
        rec = {"step": at_step, "tokens": tokens_seen, "val_loss": v, "val_ppl": math.exp(v),
               "train_loss_recent": recent_loss, "elapsed_s": round(elapsed_before + time.time() - t_loop, 1)}
        history.append(rec)
        if v < best["val_loss"]:
            best.update(val_loss=v, step=at_step,
                        state={k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()})
        return rec

    n_evals = [0]

    def checkpoint() -> None:
        every = 1 if getattr(args, "checkpoint_every", None) is None else args.checkpoint_every
        n_evals[0] += 1
        if every <= 0 or n_evals[0] % every:
            return
        _save_checkpoint(ckpt_path, {
            "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "total_steps": total_steps, "tokens_seen": tokens_seen, "sampler_rng": sampler.gen.get_state(),
            "torch_rng": torch.get_rng_state(), "history": history, "model_config": cfg.to_hf(),
            "elapsed_s": elapsed_before + time.time() - t_loop, "best_val_loss": best["val_loss"],
            "best_step": best["step"], "best_state": best["state"], "recent_losses": recent,
            "args": {k: str(v) for k, v in vars(args).items()},
        })

    # after the time budget's probe (steps 10..40), so that neither times the other
    profile = StepProfile(getattr(args, "profile_steps", 0), max(step, min(60, total_steps // 2)), device,
                          out / "step_profile")
    model.train()
    t_loop = time.time()
    recent: list[float] = list(ck.get("recent_losses", []))
    recent_loss = sum(recent) / len(recent) if recent else float("nan")
    pending = []  # device-side losses not yet read (reading each step would sync every step)
    probe_from = None
    tty = sys.stderr.isatty()
    bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True,
               mininterval=0.5 if tty else 15.0, file=sys.stderr)
    while step < total_steps:
        profile.maybe_start(step)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args, total_steps)
        x, y = sampler.next()
        try:
            with autocast():
                loss = loss_fn(x, y)
            loss.backward()
        except Exception as e:  # noqa: BLE001 - a compiler failure: redo this step eagerly
            if not compiled:
                raise
            print(f"compiled step failed ({type(e).__name__}: {e}); training eagerly", file=sys.stderr)
            loss_fn, compiled = raw_loss, False
            _uncompile_layers(model)
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_fn(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += tokens_per_step
        pending.append(loss.detach())
        if profile.maybe_stop(step) is not None:
            bar.write(format_summary(profile.summary), file=sys.stderr)
        if step % 10 == 0 or step == total_steps:
            recent.extend(float(v) for v in torch.stack(pending).cpu())
            pending.clear()
            recent = recent[-50:]
            recent_loss = sum(recent) / len(recent)
            dt = time.time() - t_loop
            bar.set_postfix(loss=f"{recent_loss:.3f}", tok_s=f"{tokens_seen / max(dt + elapsed_before, 1e-9):,.0f}",
                            refresh=False)
            if not budget_fixed:
                if probe_from is None and step >= 10:
                    probe_from = (step, time.time())  # past compile and warm-up
                elif probe_from is not None and step >= probe_from[0] + 30:
                    per_step = (time.time() - probe_from[1]) / (step - probe_from[0])
                    left = args.time_budget - (time.time() - t_start)
                    fit = step + int(0.92 * left / per_step)
                    # evaluations still to come (counted on the steps that fit, not on the asked total)
                    evals_left = max(1, (min(total_steps, fit) - step) // args.eval_every)
                    fit -= evals_left * 2
                    if fit < total_steps:
                        total_steps = max(step + 1, fit)
                        bar.total = total_steps
                        print(f"\n--time-budget {args.time_budget:.0f}s: {per_step * 1e3:.1f} ms/step -> "
                              f"{total_steps} steps", file=sys.stderr)
                    budget_fixed = True
        bar.update(1)
        if step % args.eval_every == 0 or step == total_steps:
            rec = run_eval(step)
            bar.write(f"step {step}/{total_steps}  train {recent_loss:.4f}  val {rec['val_loss']:.4f} "
                      f"(ppl {rec['val_ppl']:.2f})  {rec['elapsed_s']:.0f}s", file=sys.stderr)
            checkpoint()
    bar.close()
    if not history or history[-1]["step"] != step:
        run_eval(step)
        checkpoint()
    wall = elapsed_before + time.time() - t_loop

    if best["state"] is not None and best["step"] != step:
        model.load_state_dict(best["state"])
    model.eval()
    train_eval = evaluate(raw_loss, train_windows, args.batch_size, device, autocast)
    save_pretrained(model, cfg, out, dtype=getattr(torch, args.save_dtype))
    copy_tokenizer_files(args.tokenizer, out)
    gen_cfg = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    corpus_stats_path = Path(args.corpus) / "stats.json"
    corpus_stats = json.loads(corpus_stats_path.read_text()) if corpus_stats_path.is_file() else {}
    corpus_stats.pop("skipped_paths", None)
    n_params = count_params(model)
    stats = {
        "command": "adaspec " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name != "pytest" else None,
        "params": n_params,
        "params_non_embedding": n_params - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2),
        "model_config": cfg.to_hf(),
        "steps": step,
        "tokens_seen": tokens_seen,
        "tokens_per_step": tokens_per_step,
        "epochs": tokens_seen / max(1, int(data["train"].size)),
        "corpus_tokens": {"train": int(data["train"].size), "val": int(data["val"].size)},
        "corpus": corpus_stats,
        "kept_step": best["step"] if best["step"] >= 0 else step,
        "train_loss": recent_loss,
        "train_eval_loss": train_eval,
        "val_loss": best["val_loss"] if best["step"] >= 0 else history[-1]["val_loss"],
        "final_val_loss": history[-1]["val_loss"],
        "wall_time_s": round(wall, 1),
        "tokens_per_s": round(tokens_seen / max(wall, 1e-9)),
        "device": _device_name(device),
        "compiled": compiled,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "history": history,
    }
    if profile.summary is not None:  # where a training step's time went (train/step_profile.py)
        stats["step_profile"] = profile.summary
    stats["val_ppl"] = math.exp(stats["val_loss"])
    stats["train_ppl"] = math.exp(train_eval)
    (out / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
