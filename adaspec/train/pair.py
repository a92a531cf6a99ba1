"""`adaspec train pair`: build a target model and its DSpark drafter from nothing, in one command.

Stages, in order, each calling the code of its own command (nothing is re-implemented here):

  corpus      `train corpus` over the preset's sources (--source overrides)      -> OUT/corpus
  tokenizer   `train tokenizer`, then the corpus tokenized (per-source counts)   -> OUT/tokenizer
  target      `train target`                                                     -> OUT/target
  selfdistill the target's own continuations of corpus windows (greedy + T=1)    -> OUT/selfdistill
  drafter     `train drafter` on them, mixed with corpus text                    -> OUT/drafter
  calibrate   `train calibrate` at T=1 and T=0 on calibrate.prompts: "eval-code", the eval-code prompts the
              eval stage does not use, or "val", val-split windows; cross-fitted, kept at 1.0 when
              the fit does not lower the out-of-fold ECE  -> OUT/drafter/config.json
  eval        `eval drafter` on the shipped eval-code prompts (stdlib test split) -> OUT/drafter/eval.json,
              and the walk's blocks for policy replays -> OUT/drafter/heldout_blocks.npz
  cards       MODEL_CARD.md of both models, with the held-out figures

OUT/target and OUT/drafter load as a pair:
``LLM("OUT/target", speculative_config={"method": "dspark", "model": "OUT/drafter"})``.
OUT/pair.json summarizes the build (settings, stage timings, held-out acceptance, target loss).

Resumable: each stage writes OUT/manifest/STAGE.json with its settings and the build id of the
stage before it, first as started, then as done. A rerun skips a done stage whose settings and
input match, resumes a started one (target and drafter from their checkpoints), and refuses,
naming the difference, when they do not match; --restart-from STAGE deletes that stage's and
every later stage's outputs to rebuild them.
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
import uuid
from pathlib import Path

from adaspec.errors import AdaspecError

STAGES = ("corpus", "tokenizer", "target", "selfdistill", "drafter", "calibrate", "eval", "cards")
SELF_DISTILL_KEYS = ("sd_num_seqs", "sd_prompt_len", "sd_greedy_frac", "sd_temperature", "sd_batch", "seq_len",
                     "block_size", "seed", "sd_profile_steps")


def add_subparser(sub) -> None:
    from adaspec.train.pair_presets import PRESETS

    p = sub.add_parser("pair", help="build a target and its DSpark drafter from nothing (all stages, resumable)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=list(PRESETS), help="settings of every stage (pair_presets.py)")
    p.add_argument("--out", type=Path, required=True, help="output directory (stages, manifests, both models)")
    p.add_argument("--source", action="append", dest="sources", metavar="SRC",
                   help="corpus source, repeatable (replaces the preset's): stdlib, site-packages, DIR, NAME=DIR")
    p.add_argument("--set", action="append", dest="overrides", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one preset setting, e.g. target.layers=12 (repeatable)")
    p.add_argument("--name", help="model name in the cards (default: the preset's); the drafter is NAME-dspark")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--restart-from", choices=STAGES, help="delete this stage's and every later stage's outputs first")
    p.add_argument("--stop-after", choices=STAGES, help="stop once this stage is done")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from adaspec.train.pair_presets import apply_overrides, preset

    settings = apply_overrides(preset(args.preset), args.overrides)
    if args.sources:
        settings["corpus"]["sources"] = list(args.sources)
    summary = build_pair(args.out, settings, preset_name=args.preset, name=args.name or args.preset,
                         device=args.device, restart_from=args.restart_from, stop_after=args.stop_after)
    print(format_summary(summary), flush=True)
    return 0


# ---------------------------------------------------------------- manifests


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _differences(old: dict, new: dict) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return [f"{k}: built with {a.get(k, '(unset)')!r}, now {b.get(k, '(unset)')!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class Manifests:
    def __init__(self, out: Path):
        self.dir = Path(out) / "manifest"

    def path(self, stage: str) -> Path:
        return self.dir / f"{stage}.json"

    def read(self, stage: str) -> dict | None:
        p = self.path(stage)
        return json.loads(p.read_text()) if p.is_file() else None

    def write(self, stage: str, rec: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(stage).with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=2) + "\n")
        tmp.replace(self.path(stage))


def stage_settings(stage: str, settings: dict, name: str) -> dict:
    d = settings["drafter"]
    if stage == "selfdistill":
        return {"drafter": {k: d[k] for k in SELF_DISTILL_KEYS}}
    if stage == "drafter":
        return {"drafter": {k: v for k, v in d.items() if not k.startswith("sd_")}}
    if stage == "cards":
        return {"card": settings["card"], "name": name}
    return {stage: settings[stage]}


def stage_outputs(out: Path, stage: str) -> list[Path]:
    return {
        "corpus": [out / "corpus"],
        "tokenizer": [out / "tokenizer", out / "corpus" / "tokens"],
        "target": [out / "target"],
        "selfdistill": [out / "selfdistill"],
        "drafter": [out / "drafter"],
        "calibrate": [out / "calibrate"],
        "eval": [out / "drafter" / "eval.json", out / "drafter" / "heldout_blocks.npz"],
        "cards": [out / "target" / "MODEL_CARD.md", out / "drafter" / "MODEL_CARD.md", out / "recipe.txt"],
    }[stage]


# ---------------------------------------------------------------- the build


class Context:
    def __init__(self, out: Path, settings: dict, preset_name: str, name: str, device: str):
        import torch

        self.out, self.settings, self.preset, self.name = Path(out), settings, preset_name, name
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise AdaspecError("--device cuda asked for, but torch sees no CUDA device")
        self.device = device
        self.corpus, self.tokenizer = self.out / "corpus", self.out / "tokenizer"
        self.target, self.drafter = self.out / "target", self.out / "drafter"
        self.rows = self.out / "selfdistill" / "rows.npy"
        self.running: str | None = None  # the stage in progress


def build_pair(out: Path, settings: dict, preset_name: str, name: str, device: str = "auto",
               restart_from: str | None = None, stop_after: str | None = None, log=None) -> dict:
    """Run (or resume) every stage; returns the summary also written to OUT/pair.json."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out)
    ctx = Context(out, settings, preset_name, name, device)
    man = Manifests(out)
    if restart_from:
        for stage in STAGES[STAGES.index(restart_from):]:
            for p in stage_outputs(out, stage):
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            man.path(stage).unlink(missing_ok=True)
        log(f"pair: restarting from stage {restart_from} (its outputs and every later stage's deleted)")
    t_build = time.time()
    try:
        _run_stages(ctx, man, settings, name, stop_after, log)
    except BaseException as e:  # a stage failed: the summary says which, then the error goes on
        if ctx.running is not None:  # (a refusal before any stage ran leaves pair.json alone)
            summary = _summary(ctx, man, time.time() - t_build)
            summary["failed"] = {"stage": ctx.running, "error": f"{type(e).__name__}: {e}"}
            (out / "pair.json").write_text(json.dumps(summary, indent=2) + "\n")
        raise
    summary = _summary(ctx, man, time.time() - t_build)
    (out / "pair.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _run_stages(ctx: Context, man: Manifests, settings: dict, name: str, stop_after: str | None, log) -> None:
    prev_id = None
    for i, stage in enumerate(STAGES, 1):
        want = {"stage": stage, "settings": stage_settings(stage, settings, name), "input_build": prev_id}
        have = man.read(stage)
        tag = f"[{i}/{len(STAGES)}] {stage}"
        if have is not None:
            diff = _differences(have["settings"], want["settings"])
            if have.get("input_build") != prev_id:
                diff.append(f"input: built on another build of stage {STAGES[i - 2]!r}")
            if diff:
                raise AdaspecError(
                    f"{man.path(stage)}: stage {stage!r} was {'built' if have.get('done') else 'started'} with other "
                    f"settings ({'; '.join(diff)}). Use another --out, or rebuild it with --restart-from {stage} "
                    "(deletes the outputs of this stage and every later one).")
        if have is not None and have.get("done"):
            log(f"{tag}: done earlier ({have['seconds']:.0f} s), settings match: skipped")
        else:
            if have is not None:
                log(f"{tag}: resuming an interrupted run")
            man.write(stage, {**want, "done": False, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
            log(f"{tag}: running")
            t0 = time.time()
            ctx.running = stage
            result = STAGE_FUNCS[stage](ctx)
            ctx.running = None
            seconds = time.time() - t0
            _release_memory(stage)
            have = {**want, "done": True, "build_id": uuid.uuid4().hex, "seconds": round(seconds, 1),
                    "result": result}
            man.write(stage, have)
            log(f"{tag}: done in {seconds:.1f} s")
        prev_id = have["build_id"]
        if stage == stop_after:
            break


def _release_memory(stage: str) -> None:
    import torch

    gc.collect()
    if stage == "target":
        try:
            torch._dynamo.reset()  # the compiled training step holds the model and its buffers
        except Exception:  # noqa: BLE001 - best effort
            pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _parse(add_subparser, argv: list[str]):
    parser = argparse.ArgumentParser(prog="adaspec train")
    add_subparser(parser.add_subparsers())
    return parser.parse_args(argv)


def _flags(d: dict, skip=()) -> list[str]:
    """{"batch_size": 64, "compile": True, "x": None} -> ["--batch-size", "64", "--compile"]."""
    argv = []
    for k, v in d.items():
        if k in skip or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return argv


# ---------------------------------------------------------------- stages


def _corpus(ctx: Context) -> dict:
    from adaspec.train.corpus import build_corpus, summary_line

    c = ctx.settings["corpus"]
    stats = build_corpus(ctx.corpus, sources=c["sources"], suffixes=c["suffixes"], val_pct=c["val_pct"],
                         test_pct=c["test_pct"],
                         max_source_bytes=int(c["max_source_bytes"]) if c.get("max_source_bytes") else None)
    print(summary_line(stats), file=sys.stderr, flush=True)
    return {"files": stats["files"], "bytes": stats["bytes"], "duplicates_dropped": stats["duplicates_dropped"],
            "sources": [{k: s[k] for k in ("name", "roots", "files", "bytes", "duplicates_dropped")}
                        for s in stats["sources"]]}


def _tokenizer(ctx: Context) -> dict:
    from adaspec.train.data import load_tokens
    from adaspec.train.tokenizer import save_tokenizer, train_tokenizer

    t = ctx.settings["tokenizer"]
    t0 = time.time()
    tok = train_tokenizer(ctx.corpus, t["vocab_size"], t["min_frequency"],
                          max_bytes=int(t["max_bytes"]) if t.get("max_bytes") else None)
    save_tokenizer(tok, ctx.tokenizer, model_max_length=ctx.settings["target"]["max_position"])
    t1 = time.time()
    print(f"tokenizer: BPE trained in {t1 - t0:.1f} s; tokenizing the corpus", file=sys.stderr, flush=True)
    tokens = load_tokens(ctx.corpus, ctx.tokenizer, ("train", "val"))
    stats = json.loads((ctx.corpus / "stats.json").read_text())
    val_bytes = stats["splits"]["val"]["bytes"]
    res = {"vocab_size": tok.get_vocab_size(), "tokens": {s: int(a.size) for s, a in tokens.items()},
           "by_source": {s: v["by_source"] for s, v in stats["tokens"]["splits"].items()},
           "val_bytes_per_token": round(val_bytes / max(1, int(tokens["val"].size)), 3),
           "train_seconds": round(t1 - t0, 1), "tokenize_seconds": round(time.time() - t1, 1)}
    print(f"tokenizer: vocab {res['vocab_size']}, train {res['tokens']['train']:,} tokens, val "
          f"{res['tokens']['val']:,} ({res['val_bytes_per_token']} bytes/token)", file=sys.stderr, flush=True)
    return res


def target_flops_per_token(cfg: dict, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul parameters incl. the LM head) + causal attention."""
    d, L, hq, hkv, hd, f, V = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                               cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"])
    per_layer = d * hq * hd * 2 + d * hkv * hd * 2 + 3 * d * f
    return 6.0 * (L * per_layer + V * d) + 6.0 * seq_len * hq * hd * L


def _target(ctx: Context) -> dict:
    from adaspec.train.target import add_subparser, train_target

    t = ctx.settings["target"]
    args = _parse(add_subparser, ["target", "--corpus", str(ctx.corpus), "--tokenizer", str(ctx.tokenizer),
                                  "--out", str(ctx.target), "--device", ctx.device, "--resume", *_flags(t)])
    stats = train_target(args)
    fpt = target_flops_per_token(stats["model_config"], t["seq_len"])
    res = {k: stats[k] for k in ("params", "val_loss", "val_ppl", "train_eval_loss", "steps", "kept_step",
                                 "tokens_seen", "wall_time_s", "tokens_per_s", "compiled", "device")}
    res["train_flops_per_token"] = fpt
    if "step_profile" in stats:  # where a training step's time went (train/step_profile.py)
        res["step_profile"] = stats["step_profile"]
    res["achieved_tflops"] = round(fpt * stats["tokens_per_s"] / 1e12, 1)
    print(f"target: {stats['params'] / 1e6:.1f}M params, {stats['steps']} steps, val loss {stats['val_loss']:.4f}, "
          f"{stats['tokens_per_s']:,} tok/s = {res['achieved_tflops']} TFLOP/s (compile included)",
          file=sys.stderr, flush=True)
    return res


def _load_target(ctx: Context):
    from adaspec.models.loader import load_target

    dtype = "bfloat16" if ctx.device.startswith("cuda") else "float32"
    return load_target(ctx.target, dtype=dtype, device=ctx.device)


def _selfdistill(ctx: Context) -> dict:
    import numpy as np

    from adaspec.train.drafter import sd_profile, self_distill_rows
    from adaspec.train.drafter_data import corpus_tokens

    d = ctx.settings["drafter"]
    target, _ = _load_target(ctx)
    tokens = corpus_tokens(ctx.corpus, ctx.target)
    ns = argparse.Namespace(**{k: d[k] for k in SELF_DISTILL_KEYS})
    device = next(target.parameters()).device
    profile = sd_profile(ns, device, ctx.rows.parent)  # where a decode step's time goes (step_profile.py)
    rows = self_distill_rows(target, tokens, ns, device, profile)
    ctx.rows.parent.mkdir(parents=True, exist_ok=True)
    np.save(ctx.rows, rows)
    res = {"rows": int(rows.shape[0]), "tokens_per_row": int(rows.shape[1])}
    if profile.summary is not None:
        res["step_profile"] = profile.summary
    return res


def _drafter(ctx: Context) -> dict:
    from adaspec.train import drafter

    d = {k: v for k, v in ctx.settings["drafter"].items() if not k.startswith("sd_")}
    args = _parse(drafter.add_subparser, [
        "drafter", "--target", str(ctx.target), "--data", str(ctx.rows), "--corpus", str(ctx.corpus),
        "--out", str(ctx.drafter), "--device", ctx.device, "--resume", "--save-every", "200", *_flags(d)])
    drafter.run(args)
    log = [json.loads(x) for x in (ctx.drafter / "train_log.jsonl").read_text().splitlines() if x.strip()]
    last = log[-1] if log else {}
    out = {"steps": last.get("step"), "train_seconds": last.get("time_s"), "final_loss": last.get("loss"),
           "train_accept": last.get("accept")}
    if "heldout" in last:  # --heldout-rows: the same measure on held-out and on training self-distilled rows
        out["rows_heldout"], out["rows_train"] = last["heldout"], last["train_rows"]
    profile = ctx.drafter / "step_profile.json"
    if d.get("profile_steps") and profile.is_file():  # where a training step's time went (train/step_profile.py)
        out["step_profile"] = json.loads(profile.read_text())
    return out


def _calibrate(ctx: Context) -> dict:
    import numpy as np

    from adaspec.train import calibrate
    from adaspec.train.drafter_data import corpus_tokens, prompt_windows

    c = ctx.settings["calibrate"]
    prompts, skip = _calibration_prompts(ctx, corpus_tokens, prompt_windows, np)
    res = {}
    for temp in (1.0, 0.0):  # sampled requests' temperatures, then greedy requests'
        args = _parse(calibrate.add_subparser, [
            "calibrate", "--target", str(ctx.target), "--drafter", str(ctx.drafter), "--prompts", str(prompts),
            "--skip-prompts", str(skip),
            "--num-prompts", str(c["num_prompts"]), "--max-prompt-len", str(c["prompt_len"]),
            "--gen-len", str(c["gen_len"]), "--temperature", str(temp), "--samples", str(c["samples"]),
            "--batch-size", str(c["batch_size"]), "--device", ctx.device, "--seed", str(c["seed"])])
        calibrate.run(args)
        name = "calibration-greedy.json" if temp == 0 else "calibration.json"
        cal = json.loads((ctx.drafter / name).read_text())
        # ece_before / ece_after: raw and with the temperatures saved, each prompt half scored with
        # temperatures fitted on the other; identity when the cross-fitted STS was not adopted
        # (`adopted` false), ece_fitted the fit's out-of-fold ECE either way (None: an older file)
        res[f"T={temp:g}"] = {"temperatures": cal["temperatures"], "adopted": cal.get("adopted"),
                              "ece_before": cal["before"]["ece"], "ece_after": cal["after"]["ece"],
                              "ece_fitted": (cal.get("fitted") or {}).get("ece"), "auc": cal["after"]["auc"]}
    return res


CALIBRATION_PROMPTS = ("val", "eval-code")


def _calibration_prompts(ctx: Context, corpus_tokens, prompt_windows, np) -> tuple[str, int]:
    """-> (the prompt set `train calibrate` reads, prompts to skip in it). calibrate.prompts "val":
    windows of the corpus's val split; "eval-code": the packaged eval-code prompts after the ones
    the eval stage uses (the same distribution as the held-out figures, disjoint prompts)."""
    c, e = ctx.settings["calibrate"], ctx.settings["eval"]
    source = c.get("prompts", "val")
    if source == "eval-code":
        if e["prompts"] != "eval-code":
            raise AdaspecError(f"calibrate.prompts=eval-code needs eval.prompts=eval-code (got {e['prompts']!r}): "
                               "the calibration skips the prompts the eval uses")
        return "eval-code", int(e["num_prompts"])
    if source != "val":
        raise AdaspecError(f"calibrate.prompts={source!r}: choose one of {', '.join(CALIBRATION_PROMPTS)}")
    val = corpus_tokens(ctx.corpus, ctx.target, split="val")
    if val.size <= c["prompt_len"] + 1:
        raise AdaspecError(f"the val split has {val.size} tokens, too few for {c['prompt_len']}-token prompts")
    prompts = ctx.out / "calibrate" / "prompts.npy"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    np.save(prompts, prompt_windows(val, c["num_prompts"], c["prompt_len"], seed=c["seed"] + 1).numpy())
    return str(prompts), 0


def _eval(ctx: Context) -> dict:
    from adaspec.commands import eval as eval_cmd

    e = ctx.settings["eval"]
    parser = argparse.ArgumentParser(prog="adaspec")
    eval_cmd.add_parser(parser.add_subparsers())
    argv = ["eval", "drafter", "--target", str(ctx.target), "--drafter", str(ctx.drafter), "--prompts", e["prompts"],
            "--num-prompts", str(e["num_prompts"]), "--max-prompt-len", str(e["max_prompt_len"]),
            "--gen-len", str(e["gen_len"]), "--batch-size", str(e["batch_size"]), "--device", ctx.device,
            "--seed", str(e["seed"]), "--json", str(ctx.drafter / "eval.json"),
            "--blocks-out", str(ctx.drafter / "heldout_blocks.npz")]
    for t in e["temperatures"]:
        argv += ["--temperature", str(t)]
    eval_cmd.run_drafter(parser.parse_args(argv))
    return heldout_figures(json.loads((ctx.drafter / "eval.json").read_text()))


def heldout_figures(eval_json: dict) -> dict:
    """The acceptance figures every downstream result records: per temperature, tau and per-slot."""
    out = {"prompts": eval_json["prompts"], "num_prompts": eval_json["num_prompts"], "gen_len": eval_json["gen_len"]}
    for r in eval_json["runs"]:
        cal = r.get("confidence_calibrated") or {}
        out[f"T={r['temperature']:g}"] = {
            "tau": r["tau"], "tau_walk": r.get("tau_walk"), "cond_acceptance": r["cond_acceptance"], "blocks": r["blocks"],
            "ece_raw": r["confidence_raw"]["ece"], "ece_calibrated": cal.get("ece"),
            # the same over the blocks decoding's walk reaches (drafter_eval.walk_blocks)
            "ece_calibrated_walk": (cal or r["confidence_raw"]).get("ece_walk"),
            "auc": (cal or r["confidence_raw"])["auc"]}
    return out


def recipe_text(ctx: Context) -> str:
    cmd = f"adaspec train pair --preset {ctx.preset} --out OUT"
    lines = [cmd + "   # every stage; OUT/target + OUT/drafter", "",
             "# settings of this build (adaspec/train/pair_presets.py, after --source/--set overrides):"]
    lines += [f"#   {k} = {json.dumps(v)}" for k, v in _flatten(ctx.settings).items()]
    return "\n".join(lines) + "\n"


def _cards(ctx: Context) -> dict:
    from adaspec.train.card import write_card
    from adaspec.train.drafter_card import acceptance_table, write_drafter_card
    from adaspec.train.pair_presets import DRAFTER_SUFFIX

    c = ctx.settings["card"]
    recipe = ctx.out / "recipe.txt"
    recipe.write_text(recipe_text(ctx))
    ev = json.loads((ctx.drafter / "eval.json").read_text())
    drafter_name = ctx.name + DRAFTER_SUFFIX
    extra = "\n".join([
        f"## Speculative decoding with `{drafter_name}`", "",
        f"Held-out acceptance of the DSpark drafter built with this model ({ev['prompts']}, {ev['num_prompts']} "
        f"prompts cut from the standard library's test split, {ev['gen_len']} target tokens each; "
        "`adaspec eval drafter`):", "", *acceptance_table(ev), ""])
    target_desc = (f"A Qwen3-architecture code model trained from scratch by `adaspec train pair --preset "
                   f"{ctx.preset}` on Python sources, in minutes on one GPU, as the target of the speculative "
                   "decoding benchmark: its weights are rebuilt by the recipe below in every GPU command that "
                   "uses it (the recipe is the artifact). Not an assistant: no instruction tuning.")
    write_card(ctx.target, ctx.name, prompt_set=ctx.settings["eval"]["prompts"], num_samples=c["num_samples"],
               recipe_file=recipe, max_new_tokens=c["max_new_tokens"], description=target_desc, extra=extra,
               device=ctx.device)
    write_drafter_card(ctx.drafter, drafter_name, ctx.name, recipe=recipe.read_text(), settings=ctx.settings)
    return {"target_card": str(ctx.target / "MODEL_CARD.md"), "drafter_card": str(ctx.drafter / "MODEL_CARD.md")}


STAGE_FUNCS = {"corpus": _corpus, "tokenizer": _tokenizer, "target": _target, "selfdistill": _selfdistill,
               "drafter": _drafter, "calibrate": _calibrate, "eval": _eval, "cards": _cards}


# ---------------------------------------------------------------- summary


def _summary(ctx: Context, man: Manifests, wall: float) -> dict:
    import platform

    import torch

    stages = {s: man.read(s) for s in STAGES}
    done = {s: m for s, m in stages.items() if m and m.get("done")}
    return {
        "preset": ctx.preset, "name": ctx.name, "target_dir": str(ctx.target), "drafter_dir": str(ctx.drafter),
        "complete": len(done) == len(STAGES),
        "stage_seconds": {s: m["seconds"] for s, m in done.items()},
        "build_seconds": round(sum(m["seconds"] for m in done.values()), 1),
        "this_run_seconds": round(wall, 1),
        "heldout": done["eval"]["result"] if "eval" in done else None,
        "target": done["target"]["result"] if "target" in done else None,
        "selfdistill": done["selfdistill"]["result"] if "selfdistill" in done else None,
        "drafter": done["drafter"]["result"] if "drafter" in done else None,
        "calibration": done["calibrate"]["result"] if "calibrate" in done else None,
        "corpus": done["corpus"]["result"] if "corpus" in done else None,
        "tokenizer": done["tokenizer"]["result"] if "tokenizer" in done else None,
        "settings": ctx.settings, "device": ctx.device,
        "device_name": torch.cuda.get_device_name(0) if ctx.device.startswith("cuda") else platform.machine(),
        "torch": torch.__version__, "python": platform.python_version(),
    }


def format_summary(s: dict) -> str:
    lines = [f"pair {s['name']} ({s['preset']}): target {s['target_dir']}, drafter {s['drafter_dir']}"
             + ("" if s["complete"] else " (incomplete)")]
    lines.append("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in s["stage_seconds"].items())
                 + f"; total {s['build_seconds']:.0f} s")
    if s.get("failed"):
        lines.append(f"FAILED in stage {s['failed']['stage']}: {s['failed']['error'][:500]}")
    if s.get("target"):
        t = s["target"]
        lines.append(f"target: {t['params'] / 1e6:.1f}M params, {t['steps']} steps, {t['tokens_seen'] / 1e6:.1f}M "
                     f"tokens, val loss {t['val_loss']:.4f} (ppl {t['val_ppl']:.2f}), {t['achieved_tflops']} TFLOP/s")
    if (s.get("drafter") or {}).get("rows_heldout"):
        d = s["drafter"]
        lines.append("drafter soft acceptance per slot, held-out self-distilled rows "
                     + " ".join(f"{a:.2f}" for a in d["rows_heldout"]["accept"]) + " against training rows "
                     + " ".join(f"{a:.2f}" for a in d["rows_train"]["accept"])
                     + f" (loss {d['rows_heldout']['loss']:.3f} against {d['rows_train']['loss']:.3f})")
    if s.get("heldout"):
        h = s["heldout"]
        for key, r in h.items():
            if key.startswith("T="):
                walk = f" (decoding walk {r['tau_walk']:.3f})" if r.get("tau_walk") is not None else ""
                ece = f", ECE {r['ece_raw']:.4f} raw" if r.get("ece_raw") is not None else ""
                if r.get("ece_calibrated") is not None:
                    ece += f", {r['ece_calibrated']:.4f} calibrated"
                if r.get("ece_calibrated_walk") is not None:
                    ece += f" ({r['ece_calibrated_walk']:.4f} over the walk's blocks)"
                lines.append(f"held-out {key}: tau {r['tau']:.3f}{walk}, cond. acceptance "
                             + " ".join(f"{a:.2f}" for a in r["cond_acceptance"])
                             + f" ({r['blocks']:,} blocks, {h['num_prompts']} {h['prompts']} prompts){ece}")
    return "\n".join(lines)
