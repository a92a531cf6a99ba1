"""MODEL_CARD.md of a DSpark drafter, from the files its build left in its directory.

Read: ``config.json`` (shape, calibration temperatures), ``eval.json`` (`adaspec eval drafter`),
``calibration.json`` / ``calibration-greedy.json`` (`adaspec train calibrate`) and
``train_log.jsonl`` (`adaspec train drafter`). Every figure in the card comes from one of them.
"""
from __future__ import annotations

import json
from pathlib import Path


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def acceptance_table(eval_json: dict) -> list[str]:
    """Conditional acceptance per slot and tau, one row per evaluated temperature."""
    runs = eval_json.get("runs", [])
    if not runs:
        return []
    k = runs[0]["k"]
    # walk: the tokens per step of decoding's own walk over the same blocks (drafter_eval.walk_tau),
    # what an engine realizes; tau averages over every anchor
    # ECE walk: the confidences in use (calibrated, else raw) over the blocks the walk reaches
    out = ["| T | " + " | ".join(str(j) for j in range(1, k + 1))
           + " | **tau** | walk | blocks | ECE raw | ECE cal | ECE walk | AUC |", "|---" * (k + 8) + "|"]
    for r in runs:
        cal = r.get("confidence_calibrated") or {}
        ece_walk = (cal or r["confidence_raw"]).get("ece_walk")
        out.append(f"| {r['temperature']:g} | " + " | ".join(f"{a:.3f}" for a in r["cond_acceptance"])
                   + f" | **{r['tau']:.2f}** | " + (f"{r['tau_walk']:.2f}" if r.get("tau_walk") is not None else "-")
                   + f" | {r['blocks']:,} | {r['confidence_raw']['ece']:.4f} | "
                   + (f"{cal['ece']:.4f}" if cal else "-") + " | "
                   + (f"{ece_walk:.4f}" if ece_walk is not None else "-")
                   + f" | {(cal or r['confidence_raw'])['auc']:.3f} |")
    return out


def calibration_table(cal: dict, label: str) -> list[str]:
    """Temperatures saved and ECE before / after; a calibration that cross-fitted (`adopted` in
    it) also shows the fitted temperatures and their out-of-fold ECE, adopted or not."""
    k = len(cal["temperatures"])
    head = "| " + label + " | " + " | ".join(str(j) for j in range(1, k + 1)) + " | all |"
    rows = [head, "|---" * (k + 2) + "|",
            "| temperature T_j | " + " | ".join(f"{t:.3f}" for t in cal["temperatures"]) + " | |"]
    if "adopted" in cal:
        rows.append("| fitted T_j | " + " | ".join(f"{t:.3f}" for t in cal["fitted_temperatures"])
                    + (" | adopted |" if cal["adopted"] else " | not adopted |"))
    for when in ("before", "after") + (("fitted",) if "adopted" in cal else ()):
        rows.append(f"| ECE {when} | " + " | ".join(f"{x['ece']:.4f}" for x in cal[when]["per_slot"])
                    + f" | {cal[when]['ece']:.4f} |")
    rows.append("| AUC | " + " | ".join(f"{x['auc']:.3f}" for x in cal["after"]["per_slot"])
                + f" | {cal['after']['auc']:.3f} |")
    return rows


def render_drafter_card(drafter_dir: Path, name: str, target_name: str, recipe: str | None = None,
                        settings: dict | None = None) -> str:
    d = Path(drafter_dir)
    cfg = json.loads((d / "config.json").read_text())
    ev, cal, cal_g = _load(d / "eval.json"), _load(d / "calibration.json"), _load(d / "calibration-greedy.json")
    log = [json.loads(line) for line in (d / "train_log.jsonl").read_text().splitlines()
           if line.strip()] if (d / "train_log.jsonl").is_file() else []
    k, layers = cfg["block_size"], cfg["num_hidden_layers"]
    rows = [
        ("target", f"`{target_name}` ({cfg['num_target_layers']} layers, hidden {cfg['hidden_size']}, "
                   f"vocab {cfg['vocab_size']})"),
        ("block size k", f"{k} (anchor slot + {k - 1} mask slots, mask token {cfg['mask_token_id']})"),
        ("drafter layers", f"{layers} (Qwen3-shaped: {cfg['num_attention_heads']} heads, "
                           f"{cfg['num_key_value_heads']} KV heads, head_dim {cfg['head_dim']}, "
                           f"MLP {cfg['intermediate_size']})"),
        ("target layers read", f"`{cfg['target_layer_ids']}`, fc {len(cfg['target_layer_ids']) * cfg['hidden_size']}"
                               f" -> {cfg['hidden_size']}"),
        ("Markov head", f"{cfg.get('markov_head_type', 'vanilla')}, rank {cfg['markov_rank']}"),
        ("embedding / LM head", "frozen copies of the target's"),
    ]
    if log:
        last = log[-1]
        rows.append(("training", f"{last['step']} steps, {last['time_s']:.0f} s; final loss {last['loss']:.3f} "
                                 f"(from {log[0]['loss']:.3f} at step {log[0]['step']})"))
    out = [f"# {name}", "",
           f"A DSpark drafter (block of {k} tokens in one pass, Markov head, confidence head) for `{target_name}`, "
           "trained on the target's own continuations (self-distillation) and calibrated by Sequential "
           "Temperature Scaling, in the DeepSpec checkpoint format (`config.json` + `model.safetensors`). "
           "Load it with `LLM(TARGET_DIR, speculative_config={\"method\": \"dspark\", \"model\": THIS_DIR})`.",
           "", "| | |", "|---|---|"]
    out += [f"| {a} | {b} |" for a, b in rows]
    if ev:
        out += ["", f"## Held-out acceptance ({ev['prompts']}, {ev['num_prompts']} prompts, {ev['gen_len']} "
                    "target tokens each)", "",
                "Conditional acceptance of slot j given slots 1..j-1 were accepted, teacher-forced on the "
                "target's own continuations (`adaspec eval drafter`; T = 0: argmax match, T > 0: "
                "sum min(p, q)); tau = mean accepted length with the bonus token, fixed k, no scheduler. "
                "ECE of the survival prod c_i against observed prefix acceptance, raw and with the "
                "temperatures propose() applies at that T.", ""]
        out += acceptance_table(ev)
    for c, label in ((cal, "held-out calibration split, T = 1"), (cal_g, "held-out calibration split, T = 0")):
        if c and "adopted" in c:  # cross-fitted: both halves are fitted on and reported on
            out += ["", f"## Calibration ({label}: two prompt halves of {c['fit_blocks']:,} and "
                        f"{c['report_blocks']:,} blocks, each scored with temperatures fitted on the other)", "",
                    ("Adopted" if c["adopted"] else "Not adopted, temperatures kept at 1.0") + f": {c['reason']}. "
                    "ECE before: raw; fitted: each half with the temperatures fitted on the other; after: the "
                    "temperatures saved, " + ("fitted on both halves (figures: the fitted ones, their out-of-sample "
                                              "estimate)." if c["adopted"] else "1.0 (figures: the raw ones)."), ""]
            out += calibration_table(c, label.split(",")[1].strip())
        elif c:
            out += ["", f"## Calibration ({label}: fitted on {c['fit_blocks']:,} blocks, reported on "
                        f"{c['report_blocks']:,})", ""]
            out += calibration_table(c, label.split(",")[1].strip())
    if recipe or settings:
        out += ["", "## Recipe", ""]
        if recipe:
            out += ["```sh", recipe.rstrip("\n"), "```", ""]
        if settings:
            out += ["Settings of this build:", "", "```json", json.dumps(settings, indent=2), "```"]
    out += ["", "## Files", "",
            "`config.json` (the target's Qwen3 config + DSpark fields; calibration temperatures under "
            "`adaspec`), `model.safetensors`, `eval.json`, `calibration*.json` / `calibration*.png`, "
            "`train_log.jsonl`.", ""]
    return "\n".join(out)


def write_drafter_card(drafter_dir: Path, name: str, target_name: str, recipe: str | None = None,
                       settings: dict | None = None) -> Path:
    path = Path(drafter_dir) / "MODEL_CARD.md"
    path.write_text(render_drafter_card(drafter_dir, name, target_name, recipe, settings))
    return path
