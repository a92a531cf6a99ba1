"""Presets of `adaspec train pair`: every setting of every stage, in one nested dict per preset.

Keys of ``target`` and ``drafter`` are the flags of `adaspec train target` / `adaspec train
drafter` (dashes as underscores), so a stage runs exactly what its command would. Any key can be
overridden with ``--set SECTION.KEY=VALUE``; the manifest of each stage records what it ran with.

code-0.6b: sizing for one H200 (the GPU machine keeps nothing between commands and a command runs
at most 10 minutes, so the whole pair must build in ~4-5 minutes and leave the rest for
measurement). The FLOP arithmetic, with V = 16384 (our vocabulary), d = 1024, 28 layers:

  per layer   attention q/k/v/o 1024x2048 + 2 x 1024x1024 + 2048x1024 = 6.29M
              MLP 3 x 1024x3072 = 9.44M                                -> 15.73M
  28 layers   440.4M; tied embedding / LM head 16.8M                   -> N = 457.2M parameters
  train FLOPs per token  6 N = 2.743 GFLOP, + causal attention 6 x S x (16 x 128) x 28 at S = 512
              = 0.176 GFLOP                                            -> 2.92 GFLOP/token
  H200 bf16 dense peak 989 TFLOP/s; at 40% MFU 396 TFLOP/s             -> 135k tokens/s
  target      470 steps x 64 x 512 = 15.4M tokens = 45 PFLOP -> 114 s at 40% MFU; plus torch.compile,
              per decoder layer (``compile_mode`` layers: the 28 layers share one graph; compiling the
              whole depth as one graph took 297 s against 26 s per layer for a narrow 28-layer model on
              a loaded developer CPU), plus 2 evaluations of 131k tokens -> ~150 s. ``time_budget`` 165 s is a
              guard: on a slower machine it cuts the step count (the cosine schedule follows), on the
              expected one it does not bind, so two builds train the same steps on the same batches.
              ``checkpoint_every`` 0: no 7 GB optimizer checkpoints (the machine keeps nothing anyway).
  self-distill 4096 rows x (32 prompt + 224 sampled) tokens, three batches (greedy 1024, sampled
              2048 + 1024) of 224 decode steps; eager decode of this shape is launch-bound at ~40-60 ms
              a step (GPU.md), so 4x the rows in 2048-row batches cost what 1024 rows cost in batches of
              256 / 768: 26 s and 48 s measured (H200 run 34, two machines) against 28 s for 1024 rows
              (run 33); H100 run 51: 37.2 ms a step at 1,024 rows for 14.5 ms of kernels, 32.6 s. Since
              ae1553a the decode steps replay one CUDA graph per batch (train/self_distill.py; the eval's
              and calibration's generations too): not yet timed in a build. Why 4096: with 1024 rows each row was seen ~86 times and the drafter memorized
              them (run 33: held-out rows 0.789 at slot 1, flat after ~2,400 steps, against 0.85-0.86
              on training rows); with 4096 (~20 times each) held out 0.799 / 0.557 at slots 1 / 7
              against training rows 0.815 / 0.575 (run 34): the gap at slot 1 fell from 0.07 to
              0.016. Held-out tau 4.345 / 3.155, the top of the 1024-row builds' 4.15-4.37 / 3.09-3.15.
  drafter     2 layers (31.5M) + fc 5x1024->1024 (5.2M) trained; per step 32 rows x 256 tokens through
              the frozen target (2 N x 8192 = 7.5 TFLOP) and 32 x 64 anchors x 7 slots = 14.3k block
              tokens through the drafter's layers, LM head and target head (~4.9 TFLOP) -> 12.4 TFLOP = 31 ms
              at 40% MFU; with 1 layer 73 ms measured eagerly, 47 of them the frozen target's unfused
              elementwise work, 38 ms with ``compile`` (target layers and loss compiled: 12 s of
              compilation; H200 run 11); 2 layers measured 55 ms (H200 run 15) -> ``max_minutes`` 2.5 fits
              ~2,700 steps (the cap of 4000 steps does not bind; the box counts the host's speed: 2,147 to
              2,903 steps in H200 runs 30-31, 56-68 ms a step for 47-48 ms of kernels; with the
              drafter's pass compiled, run 32: 40 ms a step, 3,207 steps after 22 s of compilation,
              held-out tau 4.05 / 3.05, inside the earlier builds' 3.90-4.37 / 3.00-3.15: the extra
              steps did not buy acceptance). 600 steps (47 s) gave held-out tau 2.26 /
              2.10 at T = 0 / 1 and 1800 steps 3.10 / 2.63 on the same target (H200 run 8, BENCHMARKS.md):
              the drafter was under-trained, and its steps buy more acceptance than target steps would.
              On one build (H200 run 15), in the same 2.5 minutes: 1 layer 3,582 steps, tau 3.65 / 2.79;
              1 layer with 128 anchors per row 2,225 steps, 3.57 / 2.71; 2 layers 2,726 steps, 4.18 / 2.98:
              the second layer is worth its fewer steps (+14% / +7%), more anchors per row are not.
              On the next build (H200 run 16; base 2 layers, lr 1e-3, 2,733 steps, 4.06 / 2.99): lr 2e-3
              (2,941 steps) 4.19 / 3.06, training loss over its last 800 steps 1.23 against 1.31 and
              training acceptance +3 points at slots 2-7; 3 layers (2,002 steps) 4.16 / 3.02 for a dearer
              draft. Both inside the ~3% by which builds differ; lr 2e-3 is the preset's since (its
              lower loss is consistent over the run). As a whole build (H200 run 17, 2,754 steps):
              4.17 / 3.07; lr 3e-3 on that build: loss 1.18 against 1.28, tau 4.19 / 3.07 (no gain).
              With 4,096 self-distilled rows and ``max_minutes`` 3.5 (H200 run 34, one build on a slower
              machine: 50-53 ms a step, so only 3,623 steps against the 2.5-minute build's 3,366):
              4.905 / 3.263, T = 0 +13% for +8% steps and a 510 s build. Repeated (H200 run 35):
              4,000 steps (the cap, ~45 ms a step), 4.701 / 3.226 in a 473 s build, with the held-out
              rows flat from step 3,200 on (slot 1 0.802 -> 0.806): the drafter has converged on this
              data, 4.9 was that build's, and the box stays 2.5.
  calibrate   200 eval-code prompts (those after the eval's 250: the distribution the held-out figures and
              the benchmarks use, none of their prompts) x 128 tokens, at T = 1 and at T = 0: ~10 s each.
              Fitted on val-split windows (mostly site-packages), the greedy temperatures made the held-out
              ECE worse in every build that measured it: run 9 0.012 -> 0.039, run 15 0.024 -> 0.033 (1
              layer) and 0.008 -> 0.051 (2 layers). On eval-code prompts (run 16): held-out ECE 0.017 / 0.006
              at T = 0 / 1 (and 0.017 / 0.006, 0.020 / 0.005 for the run's two variants).
  eval        the first 250 eval-code prompts x 128 tokens at T = 0 and T = 1: ~10 s each.
  corpus + tokenizer: the stdlib (31 MB) and a 64 MB sample of site-packages (a developer machine
              has 270 MB of .py there; the target needs 15M tokens = ~50 MB), deduplicated (~10 s);
              BPE on a 24 MB sample (~15 s); the ~95 MB tokenized at ~1 MB/s per core on 16 cores
              (~10 s, measured 0.9 MB/s on one loaded developer core) -> ~35 s.
  cards       3 greedy samples of 64 tokens on the GPU, model loads: ~10 s (7.1 s in H100 run 51, most of it
              recomputing the whole prefix per token; since then one KV-cached batch: 1.4 s in H100 run 53).
  total       ~35 + 150 + 25 + 160 + 15 + 25 + 10 = ~410 s (measured 355-444 s; 378 s in H200 run 34,
              where the refitted box, train/time_box.py, held the drafter stage to 152 s where the
              single early fit had run it 170-184 s in run 33; 425 s in run 40; 382 s in run 41 with
              the target's features cached, the drafter stage 156 s for its 4,000 steps; 324 s in H100
              run 53, where the self-distillation, eval, calibration and cards decode through CUDA graphs:
              16.2 + 8.6 + 10.9 + 1.4 s); every stage's seconds land in pair.json. Over the issue's
              ~4-5 minutes by ~25 s: the drafter's acceptance is worth it.
The model sees 15M tokens (Chinchilla's 20 tokens per parameter would be 9.1G): far from converged, by
design of the time limit. Depths compared at equal time (benchmarks/target_shapes.py, H100 run 49,
BENCHMARKS.md: 100 s each, same data and schedule): val loss 3.32 / 2.77 / 2.33 / 2.11 at 28 / 20 / 14
/ 10 layers, so a shallower target is the better language model in this budget. The preset keeps 28
layers all the same: a pair on the 14-layer target (val loss 2.42) gave held-out tau 4.56 / 3.15,
inside or just under the 28-layer builds' 4.35-4.91 / 3.16-3.33 (the drafter, not the target's loss,
bounds acceptance here), and its cheaper steps made each draft worth less (per-user speed at one
request 1.81x no-spec at T = 1 on an H100 against the 28-layer pair's 2.65x on the H200, run 41).
`--set target.layers=14` builds that pair.
"""
from __future__ import annotations

import copy

from adaspec.errors import AdaspecError

_CODE_06B = {
    "corpus": {"sources": ["stdlib", "site-packages"], "suffixes": [".py"], "val_pct": 5, "test_pct": 5,
               "max_source_bytes": 64_000_000},
    "tokenizer": {"vocab_size": 16384, "min_frequency": 2, "max_bytes": 24_000_000},
    "target": {
        # Qwen3-0.6B's shape (head_dim 128, GQA 16/8, MLP 3072, tied embeddings) with our vocabulary
        "layers": 28, "hidden": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 3072,
        "max_position": 2048, "rope_theta": 1_000_000.0,
        "seq_len": 512, "batch_size": 64, "steps": 470, "lr": 1e-3, "warmup": 50, "min_lr_ratio": 0.1,
        "weight_decay": 0.1, "grad_clip": 1.0, "time_budget": 165, "eval_every": 235, "eval_tokens": 131072,
        "compile": True, "compile_mode": "layers", "checkpoint_every": 0, "seed": 0, "save_dtype": "bfloat16",
        "profile_steps": 3,
    },
    "drafter": {
        "layers": 2, "block_size": 7, "markov_rank": 64, "init": "target",
        "sd_num_seqs": 4096, "sd_prompt_len": 32, "sd_greedy_frac": 0.25, "sd_temperature": 1.0, "sd_batch": 2048,
        "sd_profile_steps": 3,
        "corpus_frac": 0.25, "seq_len": 256, "batch_size": 32, "anchors_per_seq": 64,
        "steps": 4000, "max_minutes": 2.5, "lr": 2e-3, "warmup": 0.04, "gamma": 4.0, "seed": 0,
        "save_dtype": "bfloat16", "log_every": 100, "compile": True, "profile_steps": 3,
        # AdamW's fused kernel on CUDA since 2026-12-03 (foreach before: builds up to H200 run 31; the
        # probe measured 47.5 against 47.7 ms a step: no gain, kept as the target's); the drafter's
        # training pass compiled since H200 run 32: 34.5 against 47.5 ms a step in
        # benchmarks/probes/drafter_step_variants.py (its kernels 32 against 46 ms: fused, not only
        # launched faster) for 13-22 s of compilation inside the box; that build made 3,207 steps
        "adamw_impl": "auto", "compile_drafter": True,
        # 64 of the self-distilled rows held out: the loss and soft acceptance on them against 64
        # training rows, every 400 steps (H200 run 32: training batches 0.82-0.85 at slot 1 against 0.75
        # held out at T = 1, each of 1,024 rows seen ~75 times; memorization or the batches' mix? Run 33,
        # two builds: memorization; held out 0.789 at slot 1, flat after ~2,400 steps, training
        # 0.85-0.86. Run 34, 4,096 rows: held out 0.799, training rows 0.815)
        "heldout_rows": 64, "heldout_every": 400,
        # the frozen target's features of the self-distilled rows computed once instead of every step
        # (train/feature_cache.py: ~1/3 of a step's kernels repeat ~23 times per row). H200 run 41, one
        # build: 11.8 GiB cached in 6.5 s, kernels 22.7 against 32.8 ms a step (run 40), 4,000 steps in
        # 148 s against 167-182 s in runs 36-40 (the step is now host-bound: 36 ms wall), the stage 156
        # against 169-185 s; held-out tau 4.698 / 3.244, inside the 4.57-4.91 / 3.20-3.33 that this
        # recipe's builds gave without it (runs 34-40)
        "cache_target_features": True,
        # the whole step replayed as one CUDA graph (train/captured_step.py): H100 run 68, one target,
        # the drafter trained both ways: steps 100-4,000 in 109.4 s against 112.1 s (~3 s a build),
        # held-out tau 4.823 / 3.330 against 4.795 / 3.322 at T = 0 / 1, and its CUDA test passed.
        # A capture that fails trains on with ordinary steps (said in the log); --set
        # drafter.cuda_graph_step=false turns it off
        "cuda_graph_step": True,
    },
    # calibration prompts: "eval-code", the packaged eval-code prompts after the eval's 250 (same
    # distribution as the held-out figures, disjoint prompts); "val", windows of the val split, made the
    # held-out greedy ECE worse in every build that measured it (the docstring; BENCHMARKS.md runs 9, 15)
    "calibrate": {"prompts": "eval-code", "num_prompts": 200, "prompt_len": 128, "gen_len": 128, "samples": 4,
                  "batch_size": 32, "seed": 0},
    "eval": {"prompts": "eval-code", "num_prompts": 250, "max_prompt_len": 512, "gen_len": 128,
             "temperatures": [0.0, 1.0], "batch_size": 32, "seed": 0},
    "card": {"num_samples": 3, "max_new_tokens": 64},
}

# Seconds on two CPU cores, for tests and for trying the recipe anywhere: a 2-layer target and a
# 1-layer drafter; the stdlib corpus by default (tests point --source at a small tree).
_MICRO = {
    "corpus": {"sources": ["stdlib"], "suffixes": [".py"], "val_pct": 20, "test_pct": 20, "max_source_bytes": None},
    "tokenizer": {"vocab_size": 512, "min_frequency": 2, "max_bytes": 2_000_000},
    "target": {
        "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128,
        "max_position": 256, "rope_theta": 10000.0,
        "seq_len": 64, "batch_size": 16, "steps": 120, "lr": 3e-3, "warmup": 20, "min_lr_ratio": 0.1,
        "weight_decay": 0.1, "grad_clip": 1.0, "time_budget": None, "eval_every": 60, "eval_tokens": 4096,
        "compile": False, "seed": 0, "save_dtype": "float32", "threads": 1, "profile_steps": 2,
    },
    "drafter": {
        "layers": 1, "block_size": 4, "markov_rank": 8, "init": "target",
        "sd_num_seqs": 48, "sd_prompt_len": 16, "sd_greedy_frac": 0.25, "sd_temperature": 1.0, "sd_batch": 48,
        "sd_profile_steps": 2,
        "corpus_frac": 0.25, "seq_len": 48, "batch_size": 8, "anchors_per_seq": 16,
        "steps": 40, "max_minutes": None, "lr": 3e-3, "warmup": 0.04, "gamma": 4.0, "seed": 0,
        "save_dtype": "float32", "log_every": 20, "profile_steps": 2, "heldout_rows": 8, "heldout_every": 20,
    },
    "calibrate": {"prompts": "val", "num_prompts": 16, "prompt_len": 24, "gen_len": 16, "samples": 2, "batch_size": 8,
                  "seed": 0},
    "eval": {"prompts": "eval-code", "num_prompts": 6, "max_prompt_len": 48, "gen_len": 16,
             "temperatures": [0.0, 1.0], "batch_size": 8, "seed": 0},
    "card": {"num_samples": 1, "max_new_tokens": 8},
}

PRESETS = {"micro": _MICRO, "code-0.6b": _CODE_06B}
DRAFTER_SUFFIX = "-dspark"


def preset(name: str) -> dict:
    if name not in PRESETS:
        raise AdaspecError(f"--preset {name!r}: unknown; choose one of {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def apply_overrides(settings: dict, items: list[str]) -> dict:
    """``SECTION.KEY=VALUE`` items (VALUE parsed as JSON when it parses, else kept as a string)."""
    import json

    for item in items:
        path, sep, raw = item.partition("=")
        section, dot, key = path.partition(".")
        if not sep or not dot or not key:
            raise AdaspecError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. target.layers=12")
        if section not in settings:
            raise AdaspecError(f"--set {item!r}: unknown section {section!r}; sections: {', '.join(settings)}")
        if key not in settings[section]:
            raise AdaspecError(f"--set {item!r}: unknown key {key!r} in {section}; keys: "
                               f"{', '.join(settings[section])}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        settings[section][key] = value
    return settings
