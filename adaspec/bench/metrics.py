"""Per-run metrics from request timings (BENCHMARK.md), under vLLM's result key names.

Pure: takes RequestResults and a duration, returns a flat dict. Times in the output are ms,
speeds tok/s. Percentiles interpolate linearly (numpy's default, as `vllm bench serve` does).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from adaspec.bench.client import RequestResult


# Metrics `--percentile-metrics` can select (vLLM's names); itl also selects our per-token ITL.
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def pct_name(q: float) -> str:
    """'99' for 99.0, '99.9' for 99.9: vLLM's spelling of a percentile in key names."""
    return str(int(q)) if float(q).is_integer() else str(q)


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _stat(values: Sequence[float], name: str, unit: str, scale: float, pcts: Iterable[int]) -> dict:
    v = [x * scale for x in values]
    out = {
        f"mean_{name}_{unit}": float(np.mean(v)) if v else None,
        f"median_{name}_{unit}": _pct(v, 50),
        f"std_{name}_{unit}": float(np.std(v)) if v else None,
    }
    for q in pcts:
        out[f"p{pct_name(q)}_{name}_{unit}"] = _pct(v, q)
    return out


def weighted_percentile(values: Sequence[float], weights: Sequence[float], q: float) -> float | None:
    """numpy's linear percentile of the values, each counted `weight` times.

    With integer weights this equals expanding each value `weight` times and taking
    `np.percentile` (method "linear", the default, as `_pct` and vLLM use), so with every weight 1
    it is `np.percentile` itself and a chunk of 3 tokens counts as 3 token gaps. A fractional
    weight covers that share of a sample: the expanded sample's k-th value is the one whose
    cumulative weight first exceeds k, and position q/100 (W - 1) of total weight W is
    interpolated between its two neighbours.
    """
    pairs = sorted((float(v), float(w)) for v, w in zip(values, weights) if w > 0)
    if not pairs:
        return None
    cum = np.cumsum([w for _, w in pairs])
    vals = [v for v, _ in pairs]

    def expanded(k: float) -> float:  # the k-th value (0-based) of the expanded sample
        i = int(np.searchsorted(cum, k, side="right"))
        return vals[min(i, len(vals) - 1)]

    h = max(0.0, q / 100.0 * (cum[-1] - 1.0))  # in numpy's order of operations
    lo = float(np.floor(h))
    a, b = expanded(lo), expanded(lo + 1.0)
    t = h - lo
    return float(a + t * (b - a)) if t else float(a)


def token_itl_samples(r: RequestResult) -> tuple[list[float], list[float]]:
    """Chunk gaps divided by the tokens they delivered, weighted by those tokens.

    Known per-chunk counts (cumulative usage in every chunk) are used as they are; otherwise
    the request's output_tokens - 1 are spread evenly over its gaps (the first chunk is taken as
    one token, as TPOT does), so the token-weighted mean equals the request's TPOT.
    """
    gaps = r.itl
    if not gaps:
        return [], []
    if r.chunk_tokens is not None and len(r.chunk_tokens) == len(r.chunk_times):
        counts = [float(c) for c in r.chunk_tokens[1:]]
    else:
        per_gap = (r.output_tokens - 1) / len(gaps)
        counts = [per_gap] * len(gaps)
    vals, wts = [], []
    for g, c in zip(gaps, counts):
        if c > 0:
            vals.append(g / c)
            wts.append(c)
    return vals, wts


def peak_in_flight(results: list[RequestResult]) -> int:
    """Most successful requests in flight at once (send to end), so a run shows the concurrency it
    reached (vLLM's max_concurrent_requests: failed requests are left out)."""
    ok = [r for r in results if r.success]
    events = sorted([(r.send_time, 1) for r in ok] + [(r.end_time, -1) for r in ok],
                    key=lambda e: (e[0], e[1]))  # an end at the same instant as a send frees first
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


# A stream whose chunks after the first all came within this of the first, though there were at
# least BURST_MIN_CHUNKS of them, was held back and flushed (server or client busy): its per-user
# speed, (tokens - 1) / (E2EL - TTFT), then measures the flush, not the decoding. H200 run 15: up
# to 50 of 256 requests of a concurrency-128 phase through the server, per-user speeds of 10^5.
BURST_S = 0.002
BURST_MIN_CHUNKS = 3
# A benchmark client whose process spent at least this many CPU seconds per wall second was CPU-bound
# (one event loop): it read the streams late, so its chunk times, per-user speeds and TTFT include its
# own lag. A suspected cause of the bursts above.
CLIENT_BUSY_CPU_PER_WALL = 0.9
# ...judged over runs of at least this many wall seconds only: a run of milliseconds (a server that
# refused every request at once, an unreachable one) is all client work, and says nothing of a lag.
CLIENT_BUSY_MIN_WALL_S = 1.0


def client_busy(cpu_per_wall: float | None) -> bool:
    """The client was CPU-bound (see CLIENT_BUSY_CPU_PER_WALL); False where it was not measured."""
    return cpu_per_wall is not None and cpu_per_wall >= CLIENT_BUSY_CPU_PER_WALL


def burst_delivered(r: RequestResult) -> bool:
    """All of a stream's chunks after the first arrived in one burst (see BURST_S)."""
    t = r.chunk_times
    return r.success and len(t) >= BURST_MIN_CHUNKS and t[-1] - t[0] < BURST_S


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def check_goodput(slos: dict | None) -> None:
    """vLLM's --goodput: {metric: SLO in ms}, metrics among GOODPUT_METRICS, SLOs >= 0."""
    for k, v in (slos or {}).items():
        if k not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: unknown metric {k!r}; use {', '.join(GOODPUT_METRICS)}")
        if not (isinstance(v, (int, float)) and v >= 0):
            raise ValueError(f"--goodput: the SLO of {k} must be a number of ms >= 0, got {v!r}")


def _tpot(r: RequestResult) -> float:
    return (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def meets_slos(r: RequestResult, slos: dict) -> bool:
    got = {"ttft": r.ttft, "tpot": _tpot(r), "e2el": r.e2el}
    return all(1000.0 * got[k] <= v for k, v in slos.items())


def compute_metrics(results: list[RequestResult], duration: float, percentiles=(90, 99),
                    percentile_metrics: Iterable[str] = PERCENTILE_METRICS, goodput: dict | None = None) -> dict:
    """Mean, median and std of every latency; `percentiles` of the `percentile_metrics` only (as
    `vllm bench serve --percentile-metrics --metric-percentiles`); request_goodput with SLOs
    (`--goodput`), else None."""
    sel = set(percentile_metrics)

    def pcts(name: str):
        return percentiles if name in sel else ()

    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.e2el for r in ok]
    itls = [g for r in ok for g in r.itl]
    tpots, speeds = [], []
    for r in ok:
        if r.output_tokens > 1:
            decode = r.e2el - r.ttft
            tpots.append(_tpot(r))
            if decode > 0:
                speeds.append((r.output_tokens - 1) / decode)
    tok_vals, tok_wts = [], []
    for r in ok:
        v, w = token_itl_samples(r)
        tok_vals += v
        tok_wts += w

    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    dur = duration if duration > 0 else float("nan")
    m: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dur,
        "request_goodput": sum(meets_slos(r, goodput) for r in ok) / dur if goodput else None,
        "output_throughput": out_tok / dur,
        "total_token_throughput": (in_tok + out_tok) / dur,
        "max_concurrent_requests": peak_in_flight(results),
        "usage_missing_requests": sum(r.usage_missing for r in ok),
        # complete streams that ended on a finish_reason without `data: [DONE]` (not failures)
        "streams_without_done": sum(r.without_done for r in ok),
        # complete streams that ended in `data: [DONE]` with no finish_reason on any chunk (counted
        # complete, as vLLM's client does; whether the answer was whole, only the server knows)
        "streams_without_finish_reason": sum(r.without_finish_reason for r in ok),
        "prompt_tokens_missing_requests": sum(r.prompt_tokens is None for r in ok),
        "total_chunks": chunks,
        "mean_tokens_per_chunk": out_tok / chunks if chunks else None,
        # streams flushed in one burst after a wait: their per-user speed is the flush's (BURST_S)
        "burst_delivered_requests": sum(burst_delivered(r) for r in ok),
    }
    m.update(_stat(ttfts, "ttft", "ms", 1000.0, pcts("ttft")))
    m.update(_stat(tpots, "tpot", "ms", 1000.0, pcts("tpot")))
    m.update(_stat(itls, "itl", "ms", 1000.0, pcts("itl")))
    m.update(_stat(e2els, "e2el", "ms", 1000.0, pcts("e2el")))
    # Token-normalized ITL: what a user feels per token when chunks carry several tokens.
    if tok_wts:
        tot = sum(tok_wts)
        m["mean_itl_token_ms"] = 1000.0 * sum(v * w for v, w in zip(tok_vals, tok_wts)) / tot
        m["median_itl_token_ms"] = 1000.0 * weighted_percentile(tok_vals, tok_wts, 50)
        for q in pcts("itl"):
            m[f"p{pct_name(q)}_itl_token_ms"] = 1000.0 * weighted_percentile(tok_vals, tok_wts, q)
    else:
        m["mean_itl_token_ms"] = m["median_itl_token_ms"] = None
        for q in pcts("itl"):
            m[f"p{pct_name(q)}_itl_token_ms"] = None
    # Per-user speed: the decode rate one user sees; p10 is the slow tail.
    m["mean_per_user_tok_s"] = float(np.mean(speeds)) if speeds else None
    m["median_per_user_tok_s"] = _pct(speeds, 50)
    m["std_per_user_tok_s"] = float(np.std(speeds)) if speeds else None
    m["p10_per_user_tok_s"] = _pct(speeds, 10)
    m["p90_per_user_tok_s"] = _pct(speeds, 90)
    return m


# The per-request lists of a result (per_request_lists, the moving load's request_phases and
# --save-detailed's generated_texts): what `bench serve --save-result` leaves out of its file
# without --save-detailed, as vLLM does with its own (input_lens, output_lens, ttfts, itls, errors, ...).
PER_REQUEST_KEYS = ("send_offsets", "input_lens", "output_lens", "ttfts", "itls", "latencies", "chunk_tokens",
                    "finish_reasons", "errors", "request_phases", "generated_texts")


def per_request_lists(results: list[RequestResult], start: float | None = None) -> dict:
    """The per-request arrays `vllm bench serve --save-result` writes (same keys), plus ours:
    `send_offsets`, when each request was sent, in seconds after `start` (the run's first send),
    so a stall can be placed in time (which requests it caught) from the result alone."""
    return {
        "send_offsets": [r.send_time - start if start is not None else None for r in results],
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [r.itl if r.success else [] for r in results],
        "latencies": [r.e2el if r.success else 0.0 for r in results],  # vLLM's name for the E2ELs
        "chunk_tokens": [r.chunk_tokens for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "errors": [r.error for r in results],
    }
