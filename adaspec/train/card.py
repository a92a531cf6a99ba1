"""`adaspec train card`: write MODEL_CARD.md for a trained model directory.

Figures come from the directory's train_stats.json; sample completions are greedy, decoded
together with a KV cache by the build's own loop (train/self_distill.sample_ragged: CUDA graph
replays on CUDA), on held-out prompts of a prompt set (default ``eval-code``, cut from the
corpus's test split). The plain loop over ``forward_dense`` before it recomputed the whole prefix
for every token, 192 eager forwards of the 28-layer target for 3 samples: presumably most of the
code-0.6b build's 7.1 s of cards (H100 run 51; the split was not measured).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from adaspec.errors import AdaspecError


def greedy_completions(model, tok, prompts: list[str], max_new_tokens: int = 64) -> list[str]:
    """Greedy continuations of ``prompts``, decoded in one batch; each stops at its first EOS, and
    all at the model's context length (the longest prompt's)."""
    from adaspec.train.self_distill import sample_ragged

    eos = tok.token_to_id("<|endoftext|>")
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    n = min(max_new_tokens, model.config.max_position_embeddings - max(len(x) for x in ids))
    if n < 1:
        return ["" for _ in prompts]
    out = []
    for x, row in zip(ids, sample_ragged(model, ids, n, temperature=0.0, batch_size=len(ids))):
        new = row[len(x):]
        out.append(tok.decode(new[:new.index(eos)] if eos in new else new, skip_special_tokens=True))
    return out


def greedy_complete(model, tok, prompt: str, max_new_tokens: int = 64) -> str:
    """Greedy continuation of ``prompt`` (stops at EOS or the model's context length)."""
    return greedy_completions(model, tok, [prompt], max_new_tokens)[0]


def pick_samples(prompts: list[str], tok, n: int, max_prompt_tokens: int = 110) -> list[str]:
    """The first ``n`` prompts of at most ``max_prompt_tokens`` tokens that end inside a block."""
    picked = []
    for p in prompts:
        lines = p.rstrip("\n").splitlines()
        if len(tok.encode(p, add_special_tokens=False).ids) <= max_prompt_tokens and lines and lines[-1][:1] == " ":
            picked.append(p)
        if len(picked) == n:
            break
    return picked or prompts[:n]


def _fence(text: str) -> str:
    return "```python\n" + text.replace("```", "`\u200b``") + ("" if text.endswith("\n") else "\n") + "```"


TINY_DESCRIPTION = (
    "A small Qwen3-architecture code model trained from scratch by `adaspec train target` on the Python "
    "standard library. It is adaspec's embedded default target: small enough to run on two CPU cores, "
    "trained enough that its completions look like Python, so speculative decoding can be measured on "
    "real acceptance rates. It is not a useful assistant: it has no instruction tuning and knows only "
    "the standard library's style.")


def corpus_description(corpus: dict) -> str:
    """One line: what the corpus held, per source when it has several."""
    sp = corpus.get("splits", {})
    sources = corpus.get("sources") or []
    if len(sources) > 1 or (sources and sources[0].get("name") != "stdlib"):
        what = "; ".join(f"{s['name']} {s['files']:,} files {s['bytes'] / 1e6:.1f} MB" for s in sources)
        what = f"Python sources of several trees ({what}; {corpus.get('duplicates_dropped', 0)} duplicate files dropped)"
    else:
        what = f"Python {corpus.get('python_version', '?')} standard library sources"
    return (f"{what}: {corpus.get('files', '?')} files, {corpus.get('bytes', 0) / 1e6:.1f} MB; "
            f"{corpus.get('skipped_not_utf8', 0)} non-UTF-8 files skipped; split by sha1 of the key: "
            f"train {sp.get('train', {}).get('files', '?')} / val {sp.get('val', {}).get('files', '?')} / "
            f"test {sp.get('test', {}).get('files', '?')} files")


def render_card(name: str, stats: dict, samples: list[tuple[str, str]], recipe: str | None,
                description: str = TINY_DESCRIPTION, extra: str | None = None) -> str:
    c = stats["model_config"]
    corpus = stats.get("corpus", {})
    hp = stats.get("hyperparameters", {})
    rows = [
        ("architecture", f"{c['architectures'][0]} ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                         f"{c['num_attention_heads']} heads x {c['head_dim']}, {c['num_key_value_heads']} KV heads, "
                         f"MLP {c['intermediate_size']}, vocab {c['vocab_size']}, "
                         f"{'tied' if c['tie_word_embeddings'] else 'untied'} embeddings, "
                         f"context {c['max_position_embeddings']})"),
        ("parameters", f"{stats['params']:,} ({stats['params_non_embedding']:,} without embeddings)"),
        ("weights", f"{c.get('torch_dtype', 'float32')} safetensors"),
        ("corpus", corpus_description(corpus)),
        ("corpus tokens", f"train {stats['corpus_tokens']['train']:,}, val {stats['corpus_tokens']['val']:,}"),
        ("tokens seen", f"{stats['tokens_seen']:,} ({stats['epochs']:.1f} epochs; {stats['steps']} steps of "
                        f"{hp.get('batch_size')} x {hp.get('seq_len')} tokens)"),
        ("optimizer", f"AdamW lr {hp.get('lr')} (warmup {hp.get('warmup')}, cosine to {hp.get('min_lr_ratio')}x), "
                      f"weight decay {hp.get('weight_decay')}, grad clip {hp.get('grad_clip')}"),
        ("final train loss", f"{stats['train_loss']:.4f} (last 50 steps); {stats['train_eval_loss']:.4f} on fixed "
                             f"train windows (ppl {math.exp(stats['train_eval_loss']):.2f})"),
        ("validation loss", f"{stats['val_loss']:.4f} (perplexity {stats['val_ppl']:.2f}), kept step "
                            f"{stats['kept_step']} of {stats['steps']}"),
        ("device", f"{stats['device']}, torch {stats['torch']}, {'torch.compile' if stats['compiled'] else 'eager'}"),
        ("wall time", f"{stats['wall_time_s']:.0f} s training loop ({stats['tokens_per_s']:,} tokens/s)"),
    ]
    out = [f"# {name}", "", description, "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    if extra:
        out += ["", extra.rstrip("\n")]
    out += ["", "## Recipe", ""]
    if recipe:
        out += ["```sh", recipe.rstrip("\n"), "```", ""]
    if stats.get("command"):
        out += ["Training command as run:", "", "```sh", stats["command"], "```", ""]
    hist = stats.get("history", [])
    if hist:
        out += ["## Validation loss during training", "", "| step | tokens | train loss (recent) | val loss | val ppl |",
                "|---|---|---|---|---|"]
        out += [f"| {h['step']} | {h['tokens']:,} | {h['train_loss_recent']:.3f} | {h['val_loss']:.4f} | "
                f"{h['val_ppl']:.2f} |" for h in hist]
        out.append("")
    out += ["## Sample completions", "",
            "Greedy, up to 64 new tokens, from a plain loop over `TargetModel.forward_dense`. Prompts are held out: "
            "they come from the `eval-code` prompt set, cut from the test split: the first three of at most 110 "
            "tokens whose last line is indented, not hand-picked (only the prompt's last lines are shown).", ""]
    for i, (prompt, completion) in enumerate(samples, 1):
        tail = "".join(prompt.splitlines(keepends=True)[-8:])
        out += [f"### Sample {i}", "", "Prompt (end):", "", _fence(tail), "", "Completion:", "", _fence(completion), ""]
    out += ["## Files", "",
            "`config.json` (Qwen3ForCausalLM), `model.safetensors`, `tokenizer.json` (byte-level BPE, special tokens "
            "`<|endoftext|>` = EOS/pad, `<|mask|>` reserved for the drafter, `<|im_start|>`/`<|im_end|>`), "
            "`tokenizer_config.json`, `generation_config.json`, `train_stats.json` (every figure above). Loads with "
            f"`adaspec.models.loader.load_target({name!r})` (this directory, or its name when embedded) and "
            "`transformers.AutoModelForCausalLM`.", ""]
    return "\n".join(out)


def write_card(model_dir: Path, name: str, prompt_set: str = "eval-code", num_samples: int = 3,
               recipe_file: Path | None = None, max_new_tokens: int = 64, description: str = TINY_DESCRIPTION,
               extra: str | None = None, device: str = "cpu") -> Path:
    from adaspec.models.loader import load_target
    from adaspec.train.prompts import load_prompt_set
    from adaspec.train.tokenizer import load_raw

    stats_path = Path(model_dir) / "train_stats.json"
    if not stats_path.is_file():
        raise AdaspecError(f"{stats_path} not found: MODEL_CARD.md is written from a training run's stats")
    stats = json.loads(stats_path.read_text())
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    stats["model_config"] = {**stats["model_config"], "torch_dtype": hf_config.get("torch_dtype", "float32")}
    # the engine's dtype on CUDA (bf16: the Triton kernel and the decode graph the build's other
    # generations use), float32 on the CPU
    model, _ = load_target(model_dir, dtype="bfloat16" if str(device).startswith("cuda") else "float32", device=device)
    tok = load_raw(model_dir)
    prompts = pick_samples(load_prompt_set(prompt_set), tok, num_samples)
    samples = list(zip(prompts, greedy_completions(model, tok, prompts, max_new_tokens)))
    recipe = Path(recipe_file).read_text() if recipe_file else None
    path = Path(model_dir) / "MODEL_CARD.md"
    path.write_text(render_card(name, stats, samples, recipe, description, extra))
    return path


def add_subparser(sub) -> None:
    p = sub.add_parser("card", help="write MODEL_CARD.md for a trained model directory", description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--name", help="title (default: the directory name)")
    p.add_argument("--prompts", default="eval-code", help="prompt set for the sample completions")
    p.add_argument("--num-samples", type=int, default=3)
    p.add_argument("--recipe", type=Path, help="script whose text is shown as the recipe")
    p.set_defaults(func=_run)


def _run(args) -> int:
    path = write_card(args.model, args.name or args.model.resolve().name, args.prompts, args.num_samples, args.recipe)
    print(f"wrote {path}")
    return 0
