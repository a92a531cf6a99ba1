"""Which target depth trains best in the build's time: issue 13 asks for Qwen3-0.6B's shape "if it
trains to a useful loss within the budget; otherwise the deepest Qwen3-shaped model that does",
with the validation losses compared. This trains the preset's target at several depths (width,
heads, MLP, vocabulary, data order, learning rate and schedule all the preset's) on one corpus and
tokenizer, each for the same wall-clock budget (`target.time_budget`: the step count is fitted to
the budget after 30 timed steps and the cosine schedule follows it), and tables their validation
losses on the same held-out tokens.

    python3 benchmarks/target_shapes.py --out DIR --figures FIGS --layers 28,16,10 --budget 100

Every shape runs the pair build's own target stage (adaspec.train.pair.build_pair with
--stop-after target) in DIR/L{layers}, on a copy of one corpus and tokenizer built once in
DIR/base. Before the first timed shape a short run of a 2-layer target compiles the shared
per-layer graph (compile_mode "layers": every depth has the same layer), so no shape's budget
pays a cold compile that the next ones find cached. Without --budget every shape trains the
preset's step count (an equal-steps comparison, e.g. for tests on the micro preset).

Writes FIGS/shapes.json (conditions, per shape: parameters, steps, tokens, val loss and its
history, tokens/s, TFLOP/s, stage seconds) and FIGS/L{layers}/ (pair.json, train_stats.json), and
prints a table. Give ADASPEC_COMMIT=<sha> so the file names the commit measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adaspec.train.pair import build_pair  # noqa: E402
from adaspec.train.pair_presets import PRESETS, apply_overrides, preset  # noqa: E402


def parse_layers(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--layers {text!r}: expected comma-separated layer counts, e.g. 28,16,10")
    if not layers or min(layers) < 1 or len(set(layers)) != len(layers):
        raise SystemExit(f"--layers {text!r}: expected distinct positive layer counts, e.g. 28,16,10")
    return layers


def shape_settings(base: dict, layers: int, budget: float | None, max_steps: int) -> dict:
    """The preset's settings with the target's depth set and, with a budget, the step count left to
    the budget (the preset's step count would otherwise stop the shallow shapes early)."""
    s = json.loads(json.dumps(base))
    s["target"]["layers"] = layers
    if budget is not None:
        s["target"]["time_budget"] = budget
        s["target"]["steps"] = max_steps
    return s


def _copy_base(base_dir: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    # the corpus and tokenizer are only read by the target stage: hard links where the filesystem allows
    try:
        shutil.copytree(base_dir, dest, copy_function=os.link)
    except OSError:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(base_dir, dest)
    for f in ("manifest/corpus.json", "manifest/tokenizer.json", "pair.json"):  # rewritten by build_pair
        p = dest / f
        if p.exists():
            text = p.read_bytes()
            p.unlink()
            p.write_bytes(text)


def shape_row(layers: int, summary: dict, stats: dict | None) -> dict:
    t = summary["target"]
    row = {"layers": layers, "params": t["params"], "steps": t["steps"], "kept_step": t.get("kept_step"),
           "tokens_seen": t["tokens_seen"], "val_loss": t["val_loss"], "val_ppl": t["val_ppl"],
           "train_eval_loss": t.get("train_eval_loss"), "tokens_per_s": t["tokens_per_s"],
           "achieved_tflops": t["achieved_tflops"], "wall_time_s": t["wall_time_s"],
           "stage_seconds": summary["stage_seconds"]["target"]}
    if stats is not None and stats.get("history"):
        row["history"] = [{k: h.get(k) for k in ("step", "tokens", "val_loss", "elapsed_s")}
                          for h in stats["history"]]
    return row


def format_table(rows: list[dict]) -> str:
    best = min(r["val_loss"] for r in rows)
    lines = ["| layers | params | steps | tokens | val loss (ppl) | vs best | tok/s | TFLOP/s | stage s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['params'] / 1e6:.1f}M | {r['steps']:,} | {r['tokens_seen'] / 1e6:.1f}M | "
                     f"{r['val_loss']:.4f} ({r['val_ppl']:.2f}) | {r['val_loss'] - best:+.4f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['achieved_tflops']} | {r['stage_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="work directory (corpus, tokenizer, one target per shape)")
    ap.add_argument("--figures", type=Path, required=True, help="small files only: shapes.json, per-shape summaries")
    ap.add_argument("--layers", required=True, help="target depths to train, e.g. 28,16,10 (in this order)")
    ap.add_argument("--budget", type=float, help="seconds of every shape's target stage (target.time_budget); "
                                                  "without it every shape trains the preset's steps")
    ap.add_argument("--max-steps", type=int, default=4000, help="step cap under --budget (default 4000)")
    ap.add_argument("--preset", default="code-0.6b", choices=list(PRESETS))
    ap.add_argument("--source", action="append", dest="sources", help="corpus source (replaces the preset's)")
    ap.add_argument("--set", action="append", dest="overrides", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-warmup", action="store_true", help="skip the 2-layer compile warm-up run")
    args = ap.parse_args(argv)
    layers = parse_layers(args.layers)
    if args.budget is not None and args.budget <= 0:
        raise SystemExit(f"--budget {args.budget}: expected seconds > 0")

    base = apply_overrides(preset(args.preset), args.overrides)
    if args.sources:
        base["corpus"]["sources"] = list(args.sources)
    args.out.mkdir(parents=True, exist_ok=True)
    args.figures.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base_dir = args.out / "base"
    base_summary = build_pair(base_dir, base, preset_name=args.preset, name=args.preset, device=args.device,
                              stop_after="tokenizer")
    warmup_s = None
    if not args.no_warmup and base["target"].get("compile"):
        w = shape_settings(base, min(2, min(layers)), None, 0)
        w["target"].update(steps=12, warmup=2, eval_every=1000, eval_tokens=8192, time_budget=None,
                           profile_steps=0)
        _copy_base(base_dir, args.out / "warmup")
        tw = time.time()
        build_pair(args.out / "warmup", w, preset_name=args.preset, name="warmup", device=args.device,
                   stop_after="target")
        warmup_s = round(time.time() - tw, 1)
        shutil.rmtree(args.out / "warmup", ignore_errors=True)
        print(f"target_shapes: compile warm-up (2 layers, 12 steps) {warmup_s} s", file=sys.stderr, flush=True)

    rows = []
    for n in layers:
        d = args.out / f"L{n}"
        _copy_base(base_dir, d)
        print(f"target_shapes: {n} layers", file=sys.stderr, flush=True)
        summary = build_pair(d, shape_settings(base, n, args.budget, args.max_steps), preset_name=args.preset,
                             name=f"L{n}", device=args.device, stop_after="target")
        stats_path = d / "target" / "train_stats.json"
        stats = json.loads(stats_path.read_text()) if stats_path.is_file() else None
        rows.append(shape_row(n, summary, stats))
        figs = args.figures / f"L{n}"
        figs.mkdir(parents=True, exist_ok=True)
        (figs / "pair.json").write_text(json.dumps(summary, indent=2) + "\n")
        if stats_path.is_file():
            shutil.copy(stats_path, figs / "train_stats.json")
        shutil.rmtree(d / "target", ignore_errors=True)  # ~1 GB of weights each at 28 layers
        # after every shape, so that a command stopped by its time limit keeps the shapes it finished
        write_result(args, base, base_summary, warmup_s, rows, t0, partial=n != layers[-1])
    print(format_table(rows), flush=True)
    return 0


def write_result(args, base: dict, base_summary: dict, warmup_s, rows: list[dict], t0: float, partial: bool) -> None:
    import torch

    result = {
        "what": "the preset's target at several depths, each trained for the same wall-clock budget on one "
                "corpus and tokenizer; validation loss on the same held-out tokens",
        "commit": os.environ.get("ADASPEC_COMMIT"), "preset": args.preset, "budget_s": args.budget,
        "max_steps": args.max_steps if args.budget is not None else None, "overrides": args.overrides,
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.device != "cpu" else "cpu",
        "torch": torch.__version__, "compile_warmup_s": warmup_s,
        "corpus_tokenizer_s": base_summary["build_seconds"], "tokenizer": base_summary["tokenizer"],
        "target_settings": {k: v for k, v in base["target"].items() if k not in ("layers",)},
        "shapes": rows, "partial": partial, "wall_s": round(time.time() - t0, 1),
    }
    (args.figures / "shapes.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
