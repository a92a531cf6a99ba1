"""The report's check of the adaptive policy's cost tables against the steps they priced.

Every adaptive server counts its decode-only drafting steps by query tokens per request q
(1 + drafts verified per request, rounded up), with what the tables priced them at and what they
took (engine/stats.py record_step_cost; /metrics `spec_decode_cost_check_*`; the bench point's
`spec_cost_check`). The wall time also holds the host's share of a step, so the absolute ratio is
above 1; what tells is the slope: when the measured cost grows with q faster than the price, the
policy verifies more drafts than pay (why this exists: H200 run 28, BENCHMARKS.md).
"""
from __future__ import annotations


WHOLE_RUN = "whole run"  # the C of a moving load's points (no one concurrency: its phases' steps together)


def pooled(points: list[dict]) -> dict[tuple[str, int | str], dict[int, list[float]]]:
    """(arm, concurrency, or WHOLE_RUN for a moving load's points) -> {q: [steps, priced ms summed,
    wall ms summed, requests summed or None]} over the repeats (None: a repeat's server did not
    count its steps' requests)."""
    out: dict[tuple[str, int | str], dict[int, list[float]]] = {}
    for p in points:
        cells = p.get("spec_cost_check")
        if not cells:
            continue
        c = p.get("concurrency")
        d = out.setdefault((p["arm"], WHOLE_RUN if c is None else int(c)), {})
        for q, (n, priced, wall, *requests) in cells.items():
            acc = d.setdefault(int(q), [0.0, 0.0, 0.0, 0.0])
            acc[0] += n
            acc[1] += n * priced
            acc[2] += n * wall
            acc[3] = None if acc[3] is None or not requests else acc[3] + n * requests[0]
    return out


def cost_check_section(points: list[dict], arms: list[str]) -> list[str]:
    """Markdown lines (none when no point has the counters: a fixed-k or non-adaspec server)."""
    data = pooled(points)
    if not data:
        return []
    qs = sorted({q for d in data.values() for q in d})
    md = ["## The adaptive policy's cost tables on the served steps (from /metrics, pooled over repeats)", "",
          "Decode-only drafting steps by query tokens per request q (1 + drafts verified per request, rounded "
          "up): steps (and their mean requests, where the server counts them), then ms per step as the cost "
          "tables priced it -> as measured (launch to launch, the host's share included, so measured > priced; "
          "compare how the two grow with q at a like batch: a measured cost that grows faster means the policy "
          "verifies more drafts than pay).", ""]
    md.append("| arm | C | " + " | ".join(f"q={q}" for q in qs) + " |")
    md.append("|---|---|" + "---|" * len(qs))
    for (arm, c) in sorted(data, key=lambda k: (arms.index(k[0]) if k[0] in arms else len(arms), k[1])):
        d = data[(arm, c)]
        row = []
        for q in qs:
            if q not in d or d[q][0] <= 0:
                row.append("–")
                continue
            n, priced, wall, requests = d[q]
            batch = "" if requests is None else f" (R {requests / n:.0f})"
            row.append(f"{int(n)}{batch}: {priced / n:.2f} -> {wall / n:.2f}")
        md.append(f"| {arm} | {c} | " + " | ".join(row) + " |")
    return md + [""]
