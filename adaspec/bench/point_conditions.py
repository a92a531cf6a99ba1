"""The conditions a sweep's points were measured under, read from the points themselves.

Each point file carries `conditions` (sweep settings, its arm's server settings, hardware,
engine commit). The report states them from here, not from the manifest, and flags any setting
whose value differs between points (a mixture the numbers would otherwise hide).
"""
from __future__ import annotations

import json

# Shared by every arm: (key, label). Arm settings are listed per arm.
SHARED = (
    ("hardware", "hardware"), ("engine_commit", "engine commit"), ("model", "model"), ("drafter", "drafter"),
    ("prompts", "prompts"), ("prompts_sha256", "prompts sha256"), ("num_prompts", "prompts per point"),
    ("prompts_per_concurrency", "at least this many waves of C prompts per point"),
    ("output_len", "output length"), ("random_range_ratio", "output length range ratio"),
    ("ignore_eos", "ignore_eos"), ("temperature", "temperature"),
    ("endpoint", "endpoint"), ("num_warmups", "warm-up requests per point"), ("seed", "seed"),
    ("load_phases", "load phases (concurrency x requests, in order)"),
    ("checkpoints", "checkpoint sha256 (bench/checkpoint_id.py)"),
)
# Shown only when some point has a value (sweeps without a moving load have none; points from
# before checkpoint ids were recorded have none).
OPTIONAL = {"load_phases", "checkpoints"}
ARM = (("speculative_config", "speculative_config"), ("server_args", "server args"), ("base_url", "base URL"))
# What a point written before a setting existed was measured with (read as that value, so old and
# new points of one sweep do not look mixed).
DEFAULTS = {"prompts_per_concurrency": 1, "random_range_ratio": 0.0}


def setting(conditions: dict, key: str):
    value = conditions.get(key, DEFAULTS.get(key))
    if key == "prompts" and isinstance(value, dict) and conditions.get("prompts_sha256"):
        # the prompts' content is vouched for by prompts_sha256: where the file lay (two checkouts'
        # eval-code.jsonl) is no condition of the measurement
        value = {k: v for k, v in value.items() if k != "path"}
    return value


def _label(p: dict) -> str:
    where = "phases" if p.get("load_phases") else f"C={p.get('concurrency')}"
    return f"{p.get('arm')} {where} r={p.get('repeat')}"


def values(points: list[dict], get) -> dict[str, list[str]]:
    """Distinct values (as JSON text) of get(conditions) -> the points that had each."""
    out: dict[str, list[str]] = {}
    for p in points:
        out.setdefault(json.dumps(get(p["conditions"]), sort_keys=True), []).append(_label(p))
    return out


def sent_prompts_groups(points: list[dict]) -> dict[str, dict[str, list[str]]]:
    """Per concurrency (a moving load: its schedule), the distinct `sent_prompts_sha256` of its points
    -> the points that sent each: points of one concurrency must have sent the same prompts (points
    from before it was recorded are left out)."""
    groups: dict[str, list[dict]] = {}
    for p in points:
        if (p.get("conditions") or {}).get("sent_prompts_sha256") is not None:
            where = "the load phases" if p.get("load_phases") else f"C={p.get('concurrency')}"
            groups.setdefault(where, []).append(p)
    return {where: values(ps, lambda c: c.get("sent_prompts_sha256")) for where, ps in groups.items()}


def mixed_settings(points: list[dict]) -> list[str]:
    """Names of the settings whose value differs between points (arm settings within an arm; the
    prompts sent within a concurrency)."""
    pts = [p for p in points if p.get("conditions")]
    mixed = [label for key, label in SHARED if len(values(pts, lambda c, k=key: setting(c, k))) > 1]
    mixed += [f"prompts sent at {where}" for where, vals in sent_prompts_groups(pts).items() if len(vals) > 1]
    for arm in sorted({p.get("arm") for p in pts}, key=str):
        mine = [p for p in pts if p.get("arm") == arm]
        mixed += [f"{label} of arm {arm}" for key, label in ARM
                  if len(values(mine, lambda c, k=key: (c.get("arm") or {}).get(k))) > 1]
    return mixed


def lines(points: list[dict], describe_hardware) -> list[str]:
    """Markdown list items: one per setting; a mixed one lists every value with its points."""
    pts = [p for p in points if p.get("conditions")]
    out = []
    if len(pts) < len(points):
        out.append(f"- **{len(points) - len(pts)} points carry no conditions** (written before points recorded "
                   "them); what follows describes the other points only")

    def show(key, v):
        v = json.loads(v)
        if key == "hardware" and v:
            return describe_hardware(v)
        return f"`{v if isinstance(v, str) else json.dumps(v)}`"

    def item(label, key, vals, indent=""):
        if len(vals) == 1:
            return [f"{indent}- {label}: {show(key, next(iter(vals)))}"]
        res = [f"{indent}- **{label}: MIXED**, the points were measured with different values:"]
        res += [f"{indent}  - {show(key, v)}: {', '.join(who)}" for v, who in vals.items()]
        return res

    for key, label in SHARED:
        vals = values(pts, lambda c, k=key: setting(c, k))
        if key in OPTIONAL and list(vals) == ["null"]:
            continue
        out += item(label, key, vals)
    for where, vals in sent_prompts_groups(pts).items():
        if len(vals) > 1:
            out += item(f"prompts sent at {where} (sha256)", "sent_prompts_sha256", vals)
    out.append("- arms:")
    for arm in sorted({p.get("arm") for p in pts}, key=str):
        mine = [p for p in pts if p.get("arm") == arm]
        out.append(f"  - `{arm}`:")
        for key, label in ARM:
            vals = values(mine, lambda c, k=key: (c.get("arm") or {}).get(k))
            if list(vals) != ["null"]:
                out += item(label, key, vals, indent="    ")
    return out
