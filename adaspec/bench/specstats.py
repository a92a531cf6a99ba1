"""Speculation counters scraped from a server's Prometheus /metrics, before and after a run.

Names are matched by suffix (`spec_decode_num_drafts`, ...), so `adaspec:` and `vllm:` prefixes
both work. Label sets are summed, except `position` for the per-position counter.
"""
from __future__ import annotations

SUFFIXES = {
    "spec_decode_num_drafts": "drafts",
    "spec_decode_num_draft_tokens": "draft_tokens",
    "spec_decode_num_accepted_tokens": "accepted_tokens",
    "spec_decode_num_verified_tokens": "verified_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
    # adaspec only: the calibration view, per position: drafts verified, and the sum of their
    # predicted survival (the policy's expectation of the accepted count)
    "spec_decode_num_verified_tokens_per_pos": "verified_per_pos",
    "spec_decode_predicted_accepted_tokens_per_pos": "predicted_per_pos",
    "spec_decode_budget_steps": "budget_steps",  # adaspec only: engine steps by verification budget B
    # adaspec only: the adaptive policy's cost tables against the decode-only drafting steps they
    # priced, by query tokens per request (engine/stats.py record_step_cost)
    "spec_decode_cost_check_steps": "cost_check_steps",
    "spec_decode_cost_check_priced_ms": "cost_check_priced_ms",
    "spec_decode_cost_check_wall_ms": "cost_check_wall_ms",
    "spec_decode_cost_check_requests": "cost_check_requests",
    # adaspec only: the engine's steps and the wall seconds spent inside them (engine_delta)
    "engine_steps": "engine_steps",
    "engine_step_seconds": "engine_step_seconds",
}
_LABELED = {"accepted_per_pos": "position", "verified_per_pos": "position", "predicted_per_pos": "position",
            "budget_steps": "budget", "cost_check_steps": "query_len", "cost_check_priced_ms": "query_len",
            "cost_check_wall_ms": "query_len", "cost_check_requests": "query_len"}
# adaspec only: present when acceptance follows a configured curve (method "synthetic"); its
# label "note" says so ("synthetic acceptance: timing only")
SYNTHETIC_SUFFIX = "spec_decode_synthetic_acceptance"


def parse_spec_counters(text: str) -> dict:
    """{"drafts": float, ..., "accepted_per_pos": {pos: float}}; only counters that exist."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if name.endswith("_created"):
                continue  # creation timestamps, not counts
            if name.endswith(SYNTHETIC_SUFFIX) and s.value:
                out["synthetic"] = s.labels.get("note") or "synthetic acceptance"
                continue
            if name.endswith("_total"):
                name = name[: -len("_total")]
            key = next((k for suf, k in SUFFIXES.items() if name.endswith(suf)), None)
            if key is None:
                continue
            if key in _LABELED:
                lab = int(float(s.labels.get(_LABELED[key], 0)))
                d = out.setdefault(key, {})
                d[lab] = d.get(lab, 0.0) + s.value
            else:
                out[key] = out.get(key, 0.0) + s.value
    return out


def spec_delta(before: dict | None, after: dict | None) -> dict:
    """Counters moved during the run and the rates derived from them; None where unknown."""
    keys = ["drafts", "draft_tokens", "accepted_tokens", "verified_tokens"]
    res: dict = {f"spec_num_{k}": None for k in keys}
    res.update(
        spec_acceptance_rate=None,
        spec_mean_accepted_length=None,
        spec_mean_verified_length=None,
        spec_accepted_per_pos=None,
        spec_acceptance_rate_per_pos=None,
        spec_verified_per_pos=None,
        spec_predicted_per_pos=None,
        # accepted drafts / their predicted survival summed: 1 when the confidences the policy
        # plans with are calibrated on the served traffic, < 1 when they promise too much
        spec_calibration_ratio=None,
        spec_calibration_ratio_per_pos=None,
        spec_budget_steps=None,
        # the adaptive policy's cost tables on the served steps: {query_len: [steps, mean priced ms,
        # mean wall ms, mean requests (servers before the requests counter: absent)]} and, over all
        # of them, wall / priced (> 1: the steps cost more than priced; the host's share is in the
        # wall time, so the slope over query_len at a like batch is what tells)
        spec_cost_check=None,
        spec_cost_ratio=None,
        spec_synthetic_acceptance=None,  # the server's note when its acceptance was synthetic
    )
    if after is not None:
        res["spec_synthetic_acceptance"] = after.get("synthetic")
    if before is None or after is None:
        return res
    for k in keys:
        if k in after:
            res[f"spec_num_{k}"] = after[k] - before.get(k, 0.0)
    drafts, draft_tok = res["spec_num_drafts"], res["spec_num_draft_tokens"]
    acc, ver = res["spec_num_accepted_tokens"], res["spec_num_verified_tokens"]
    if acc is not None and draft_tok:
        res["spec_acceptance_rate"] = acc / draft_tok
    if acc is not None and drafts:
        res["spec_mean_accepted_length"] = 1.0 + acc / drafts  # the bonus token counts
    if ver is not None and drafts:
        res["spec_mean_verified_length"] = ver / drafts
    # a labelled counter appears once it first moves (prometheus-client, vLLM's too): a position no
    # draft was accepted at yet is missing from the accepted series while the verified one has it,
    # so the lists are laid over every position any per-position series shows, the missing ones 0
    per_pos = ("accepted_per_pos", "verified_per_pos", "predicted_per_pos")
    positions = sorted({p for key in per_pos for p in after.get(key, {})})
    for key in per_pos:
        # a server that counts accepted tokens but accepted none at any position yet has no series
        absent_zero = key == "accepted_per_pos" and "accepted_tokens" in after and positions
        if key in after or absent_zero:
            b, a = before.get(key, {}), after.get(key, {})
            res[f"spec_{key}"] = [a.get(p, 0.0) - b.get(p, 0.0) for p in positions]
    per = res["spec_accepted_per_pos"]
    if per is not None and drafts:
        res["spec_acceptance_rate_per_pos"] = [x / drafts for x in per]
    pred, per = res["spec_predicted_per_pos"], res["spec_accepted_per_pos"]
    if pred is not None and per is not None and len(pred) == len(per):
        res["spec_calibration_ratio_per_pos"] = [a / q if q > 0 else None for a, q in zip(per, pred)]
        if sum(pred) > 0:
            res["spec_calibration_ratio"] = sum(per) / sum(pred)
    if "cost_check_steps" in after:
        moved = {key: {q: v - before.get(key, {}).get(q, 0.0) for q, v in after.get(key, {}).items()}
                 for key in ("cost_check_steps", "cost_check_priced_ms", "cost_check_wall_ms", "cost_check_requests")}
        n, priced, wall = moved["cost_check_steps"], moved["cost_check_priced_ms"], moved["cost_check_wall_ms"]
        reqs = moved["cost_check_requests"] if "cost_check_requests" in after else None
        cells = {str(q): [n[q], priced.get(q, 0.0) / n[q], wall.get(q, 0.0) / n[q]]
                 + ([reqs.get(q, 0.0) / n[q]] if reqs is not None else []) for q in sorted(n) if n[q] > 0}
        res["spec_cost_check"] = cells or None
        total_priced = sum(priced.get(q, 0.0) for q in n if n[q] > 0)
        if total_priced > 0:
            res["spec_cost_ratio"] = sum(wall.get(q, 0.0) for q in n if n[q] > 0) / total_priced
    if "budget_steps" in after:
        b = before.get("budget_steps", {})
        moved = {str(k): after["budget_steps"][k] - b.get(k, 0.0) for k in sorted(after["budget_steps"])}
        res["spec_budget_steps"] = {k: v for k, v in moved.items() if v}
    return res


def engine_delta(before: dict | None, after: dict | None, duration: float, output_tokens: int) -> dict:
    """The engine's steps during the run (adaspec servers only; None elsewhere): how many, the wall
    time inside step() calls per step (a little high under async scheduling, where a call that only
    reads back the step in flight counts no step), output tokens per step, and the share of the
    run's wall time spent inside steps (engine_busy_fraction; well under 1 with requests waiting
    means the engine's loop, not its steps, is the bound: taking requests and sending news, or a
    server that feeds it too slowly)."""
    res = dict(engine_steps=None, engine_step_seconds=None, engine_mean_step_ms=None,
               engine_output_tokens_per_step=None, engine_busy_fraction=None)
    if before is None or after is None or "engine_steps" not in after:
        return res
    steps = after["engine_steps"] - before.get("engine_steps", 0.0)
    res["engine_steps"] = steps
    if steps > 0:
        res["engine_output_tokens_per_step"] = output_tokens / steps
    if "engine_step_seconds" in after:
        secs = after["engine_step_seconds"] - before.get("engine_step_seconds", 0.0)
        res["engine_step_seconds"] = secs
        if steps > 0:
            res["engine_mean_step_ms"] = 1000.0 * secs / steps
        if duration > 0:
            res["engine_busy_fraction"] = secs / duration
    return res


async def scrape(session, base_url: str, headers: dict | None = None) -> dict | None:
    """Counters from base_url/metrics, or None when the server has no usable /metrics."""
    import aiohttp

    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
        return parse_spec_counters(text)
    except (aiohttp.ClientError, ValueError, OSError):
        return None
