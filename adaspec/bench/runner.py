"""One benchmark run (`adaspec bench serve`): warm-up, scrape, timed requests, scrape, metrics."""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from adaspec.bench import client, metrics, phases as phases_mod, specstats
from adaspec.bench.lengths import output_lengths
from adaspec.errors import AdaspecError


class BenchError(AdaspecError):
    """A benchmark that cannot run as asked (server unreachable, bad arguments)."""


@dataclass
class BenchConfig:
    base_url: str
    model: str | None
    prompts: list[str]
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    output_len: int | None = 128
    # each request's max_tokens drawn from [L(1 - r), L(1 + r)] (lengths.py); 0: all output_len
    random_range_ratio: float = 0.0
    ignore_eos: bool = False
    temperature: float = 1.0
    num_warmups: int = 0
    endpoint: str = "completions"  # the API spoken: completions or chat
    endpoint_path: str | None = None  # the path posted to; None: /v1/completions or /v1/chat/completions
    api_key: str | None = None
    seed: int = 0
    label: str | None = None
    continuous_usage: bool = False
    request_seeds: bool = False  # send seed = seed + i with each sampled request
    request_timeout: float = 6 * 3600
    progress: bool = True
    extra: dict = field(default_factory=dict)  # recorded as is in the result (sweep's arm, repeat, ...)
    clock: Callable[[], float] = time.perf_counter  # request timestamps; tests inject a fake clock
    # (this process's CPU seconds, wall seconds) for client_cpu_per_wall: real ones whatever `clock` is
    cpu_clocks: tuple[Callable[[], float], Callable[[], float]] = (time.process_time, time.perf_counter)
    percentile_metrics: tuple = metrics.PERCENTILE_METRICS
    metric_percentiles: tuple = (90, 99)  # the sweep's report reads p99s; bench serve passes vLLM's defaults
    # A moving load (phases.py): the concurrency cap changes phase by phase; prompts are sent in
    # order, phase after phase (one prompt per request: len(prompts) == the phases' requests).
    load_phases: list | None = None
    # vLLM's --goodput: SLOs in ms by metric (ttft, tpot, e2el); request_goodput counts the
    # requests that meet every one of them, per second. None: not measured (the key is null)
    goodput: dict | None = None
    # vLLM's --backend as given (openai, vllm, openai-chat), recorded as the result's "backend"; None:
    # openai or openai-chat by the endpoint
    backend: str | None = None
    # vLLM's --served-model-name: the model name sent in the requests (None: `model`, or the server's)
    served_model_name: str | None = None
    # vLLM's sampling flags: top_p, top_k, min_p sent in every request body when given (None: not sent)
    sampling: dict = field(default_factory=dict)
    # vLLM's --request-id-prefix: request i carries the header x-request-id: PREFIX + i (None: no header)
    request_id_prefix: str | None = None
    # vLLM's --ready-check-timeout-sec: wait up to this many seconds for /v1/models to answer (a status
    # below 500) before anything is sent; 0: no wait (the sweep waits for its own servers' /health)
    ready_check_timeout: float = 0.0
    # keep each request's text as `generated_texts` (vLLM's --save-detailed writes them)
    keep_texts: bool = False


# Seconds between two tries of the ready check (tests shorten it).
READY_POLL_S = 1.0


def normalize_base_url(url: str) -> str:
    # Accept vLLM-style roots and OpenAI-style ".../v1" alike.
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(cfg: BenchConfig) -> dict:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def _resolve_model(session, base: str, headers: dict) -> str:
    # Like `vllm bench serve` without --model: ask the server what it serves.
    import aiohttp

    try:
        async with session.get(base + "/v1/models", headers=headers) as resp:
            data = await resp.json()
        return data["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError, ValueError, OSError) as e:
        raise BenchError(f"no --model given and {base}/v1/models did not name one ({e})") from None


async def wait_ready(base: str, headers: dict, timeout_s: float, log=None) -> None:
    """Until the server answers GET /v1/models with a status below 500 (it is up and routing;
    a 401 or 404 says so too), for at most timeout_s seconds (vLLM's --ready-check-timeout-sec).
    vLLM sends a test request until one succeeds; the warm-ups do that here, and a server that
    refuses a request stays measurable (its failures are the result)."""
    import aiohttp

    if not timeout_s > 0:
        return
    deadline = time.monotonic() + timeout_s
    said = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=min(10.0, timeout_s))) as session:
        while True:
            try:
                async with session.get(base + "/v1/models", headers=headers) as resp:
                    if resp.status < 500:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"{base} did not answer GET /v1/models within {timeout_s:g} s "
                                 f"(--ready-check-timeout-sec; 0 skips the wait); last: {last}")
            if not said and log:
                log(f"waiting up to {timeout_s:g} s for {base} to answer ({last})")
                said = True
            await asyncio.sleep(min(READY_POLL_S, left))


def server_model(base_url: str, api_key: str | None = None, ready_timeout: float = 0.0) -> str:
    """The model a server names first at /v1/models (after the ready check), as `vllm bench serve`
    takes it without --model."""
    import aiohttp

    async def ask() -> str:
        base, headers = normalize_base_url(base_url), {"Authorization": f"Bearer {api_key}"} if api_key else {}
        await wait_ready(base, headers, ready_timeout, _stderr)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await _resolve_model(session, base, headers)

    return asyncio.run(ask())


def _stderr(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


async def run_benchmark_async(cfg: BenchConfig) -> dict:
    import aiohttp

    if cfg.endpoint not in ("completions", "chat"):
        raise BenchError(f"--endpoint must be completions or chat, got {cfg.endpoint!r}")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be at least 1, got {cfg.max_concurrency}")
    if cfg.num_warmups < 0:
        raise BenchError(f"--num-warmups must be at least 0, got {cfg.num_warmups}")
    for flag, v in (("--request-rate", cfg.request_rate), ("--burstiness", cfg.burstiness)):
        if not v > 0:  # NaN too; vLLM refuses a rate of 0 as well (inf, the default rate, is a closed loop)
            raise BenchError(f"{flag} must be > 0 (inf allowed), got {v}")
    try:
        metrics.check_goodput(cfg.goodput)
    except ValueError as e:
        raise BenchError(str(e)) from None
    phase_idx, caps = None, None
    if cfg.load_phases:
        if cfg.max_concurrency is not None or cfg.request_rate != float("inf"):
            raise BenchError("--load-phases sets the concurrency phase by phase; drop --max-concurrency/--request-rate")
        phase_idx = phases_mod.phase_of_requests(cfg.load_phases)
        if len(phase_idx) != len(cfg.prompts):
            raise BenchError(f"--load-phases {phases_mod.format_phases(cfg.load_phases)} sends {len(phase_idx)} "
                             f"requests but {len(cfg.prompts)} prompts were given")
        caps = [cfg.load_phases[p].max_concurrency for p in phase_idx]
    base = normalize_base_url(cfg.base_url)
    url = base + (cfg.endpoint_path or ("/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"))
    headers = _headers(cfg)
    await wait_ready(base, headers, cfg.ready_check_timeout, _stderr)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        model = cfg.model or await _resolve_model(session, base, headers)
    sent_model = cfg.served_model_name or model

    if cfg.random_range_ratio and cfg.output_len is None:
        raise BenchError("random_range_ratio spreads output_len, which is not set (no max_tokens is sent)")
    lengths = output_lengths(len(cfg.prompts), cfg.output_len, cfg.random_range_ratio, cfg.seed) \
        if cfg.random_range_ratio else None

    def payload(i: int, prompt: str, measured: bool = True) -> dict:
        spec = client.RequestSpec(
            prompt=prompt,
            max_tokens=lengths[i] if lengths is not None and measured else cfg.output_len,
            temperature=cfg.temperature,
            ignore_eos=cfg.ignore_eos,
            # Off by default, as in `vllm bench serve`: per-request seeds can cost the server speed.
            seed=cfg.seed + i if cfg.request_seeds and cfg.temperature > 0 else None,
            extra_body={k: v for k, v in cfg.sampling.items() if v is not None},
        )
        return client.build_payload(spec, sent_model, cfg.endpoint, cfg.continuous_usage)

    def ids(prefix: str, n: int) -> list[str] | None:
        return None if cfg.request_id_prefix is None else [f"{cfg.request_id_prefix}{prefix}{i}" for i in range(n)]

    if cfg.num_warmups:
        # Not measured: fills caches, compiles kernels, sizes buffers at this concurrency.
        warm = [payload(i, cfg.prompts[i % len(cfg.prompts)], measured=False) for i in range(cfg.num_warmups)]
        # A moving load warms up at its highest phase concurrency.
        warm_cap = max(caps) if caps else cfg.max_concurrency
        wres, _, _ = await client.run_requests(
            url, warm, cfg.endpoint, warm_cap, [0.0] * len(warm), headers, cfg.request_timeout,
            clock=cfg.clock, request_ids=ids("warmup-", len(warm)),
        )
        if all(not r.success for r in wres):
            raise BenchError(f"every warm-up request to {url} failed; first error: {wres[0].error}")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        before = await specstats.scrape(session, base, headers)

    payloads = [payload(i, p) for i, p in enumerate(cfg.prompts)]
    offsets = client.arrival_offsets(len(payloads), cfg.request_rate, cfg.burstiness, cfg.seed)
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(payloads), desc=cfg.label or "requests", unit="req", leave=False)
    started = datetime.now(timezone.utc)
    cpu_now, wall_now = cfg.cpu_clocks
    cpu0, wall0 = cpu_now(), wall_now()
    try:
        results, first, last = await client.run_requests(
            url, payloads, cfg.endpoint, cfg.max_concurrency, offsets, headers, cfg.request_timeout,
            on_done=(lambda r: bar.update(1)) if bar else None, clock=cfg.clock, caps=caps,
            request_ids=ids("", len(payloads)),
        )
    finally:
        if bar:
            bar.close()
    wall = wall_now() - wall0
    # not measured (null) over a run too short to tell a busy client (metrics.CLIENT_BUSY_MIN_WALL_S)
    client_cpu = round((cpu_now() - cpu0) / wall, 3) if wall >= metrics.CLIENT_BUSY_MIN_WALL_S else None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        after = await specstats.scrape(session, base, headers)

    out: dict = {
        "date": started.strftime("%Y%m%d-%H%M%S"),  # vLLM's format (here in UTC)
        "started_at": started.isoformat(timespec="seconds"),
        "backend": cfg.backend or ("openai-chat" if cfg.endpoint == "chat" else "openai"),
        "label": cfg.label,
        "base_url": base,
        "endpoint": cfg.endpoint,
        "endpoint_path": url[len(base):],
        "model_id": model,
        "served_model_name": cfg.served_model_name,
        "num_prompts": len(payloads),
        "max_concurrency": cfg.max_concurrency,
        "request_rate": "inf" if cfg.request_rate == float("inf") else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "output_len": cfg.output_len,
        "random_range_ratio": cfg.random_range_ratio,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        **{k: cfg.sampling.get(k) for k in ("top_p", "top_k", "min_p")},
        "request_id_prefix": cfg.request_id_prefix,
        "num_warmups": cfg.num_warmups,
        "seed": cfg.seed,
        "metrics_available": after is not None,
        # the client process's CPU seconds per wall second while the requests ran (metrics.CLIENT_BUSY_CPU_PER_WALL)
        "client_cpu_per_wall": client_cpu,
        "client_wall_s": round(wall, 3),  # the wall seconds it was measured over
    }
    out.update(metrics.compute_metrics(results, last - first, cfg.metric_percentiles, cfg.percentile_metrics,
                                       cfg.goodput))
    if cfg.load_phases:
        out["load_phases"] = phases_mod.format_phases(cfg.load_phases)
        out["phases"] = phases_mod.phase_metrics(results, phase_idx, cfg.load_phases, first, cfg.metric_percentiles,
                                                 cfg.percentile_metrics, cfg.goodput)
        out["request_phases"] = phase_idx
    out.update(specstats.spec_delta(before, after))
    out.update(specstats.engine_delta(before, after, out["duration"], out["total_output_tokens"]))
    out.update(metrics.per_request_lists(results, first))
    if cfg.keep_texts:
        out["generated_texts"] = [r.text for r in results]
    out.update(cfg.extra)
    return out


def run_benchmark(cfg: BenchConfig) -> dict:
    return asyncio.run(run_benchmark_async(cfg))


def write_json_atomic(path: str, data: dict) -> None:
    # Write-then-rename: an interrupted sweep never leaves a half-written point that looks done.
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_finite(data), f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _finite(o):
    # NaN/inf are not JSON; a quantity that could not be measured is null.
    if isinstance(o, float) and (o != o or o in (float("inf"), float("-inf"))):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def result_filename(res: dict) -> str:
    """vLLM's default --save-result name: LABEL-RATEqps[-concurrencyC]-MODEL-YYYYmmdd-HHMMSS.json."""
    label = res.get("label") or res.get("backend")
    conc = f"-concurrency{res['max_concurrency']}" if res.get("max_concurrency") is not None else ""
    if res.get("load_phases"):
        conc = "-phases" + res["load_phases"].replace(",", "-")
    rate = res.get("request_rate")
    model = str(res.get("model_id") or "model").rstrip("/").split("/")[-1]
    when = res["date"]
    return f"{label}-{rate}qps{conc}-{model}-{when}.json"


def format_summary(res: dict) -> str:
    """The console block `bench serve` prints (vLLM's layout, plus per-user speed and spec stats)."""

    def f(key: str, unit: str = "", nd: int = 2) -> str:
        v = res.get(key)
        return "n/a" if v is None else (f"{v:.{nd}f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    lines = [
        "=" * 22 + " Serving Benchmark Result " + "=" * 22,
        f"{'Successful requests:':<40}{f('completed')}",
        f"{'Failed requests:':<40}{f('failed')}",
        f"{'Benchmark duration (s):':<40}{f('duration')}",
        f"{'Total input tokens:':<40}{f('total_input_tokens')}",
        f"{'Total generated tokens:':<40}{f('total_output_tokens')}",
        f"{'Request throughput (req/s):':<40}{f('request_throughput')}",
    ] + ([f"{'Request goodput (req/s):':<40}{f('request_goodput')}"] if res.get("request_goodput") is not None else []) + [
        f"{'Output token throughput (tok/s):':<40}{f('output_throughput')}",
        f"{'Total token throughput (tok/s):':<40}{f('total_token_throughput')}",
        f"{'Per-user speed median (tok/s):':<40}{f('median_per_user_tok_s')}",
        f"{'Per-user speed p10 (tok/s):':<40}{f('p10_per_user_tok_s')}",
    ]
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL (per chunk)", "itl"), ("ITL (per token)", "itl_token"), ("E2EL", "e2el")):
        lines.append(f"{'-' * 20}{name:^30}{'-' * 20}")
        pcts = [k.split("_", 1)[0] for k in res if k.startswith("p") and k.endswith(f"_{key}_ms")
                and k.split("_", 1)[1] == f"{key}_ms"]
        for stat in ["mean", "median"] + pcts:
            lines.append(f"{f'{stat.capitalize()} {name} (ms):':<40}{f(f'{stat}_{key}_ms')}")
    if res.get("spec_synthetic_acceptance"):  # first, so nobody reads the figures without it
        lines.insert(1, f"NOTE: {res['spec_synthetic_acceptance']} (the server drew acceptance from a configured curve)")
    if res.get("spec_num_drafts"):
        lines.append(f"{'-' * 20}{'Speculative decoding':^30}{'-' * 20}")
        lines.append(f"{'Acceptance rate:':<40}{f('spec_acceptance_rate', '', 3)}")
        lines.append(f"{'Mean accepted length:':<40}{f('spec_mean_accepted_length', '', 3)}")
        per = res.get("spec_acceptance_rate_per_pos") or []
        lines.append(f"{'Per-position acceptance:':<40}{' '.join(f'{x:.2f}' for x in per)}")
    if res.get("phases"):
        lines.append(f"{'-' * 20}{'Load phases':^30}{'-' * 20}")
        lines.append(f"{'phase':<8}{'C x requests':>14}{'span (s)':>16}{'out tok/s':>12}{'user tok/s p50':>16}"
                     f"{'p90':>8}{'TTFT p50 ms':>13}")
        for ph in res["phases"]:
            span = f"{ph['start_s']:.1f}-{ph['end_s']:.1f}"
            lines.append(f"{ph['phase']:<8}{ph['max_concurrency']:>7}x{ph['num_requests']:<6}{span:>16}"
                         + "".join(_fmt(ph.get(k), w) for k, w in (("output_throughput", 12), ("median_per_user_tok_s", 16),
                                                                   ("p90_per_user_tok_s", 8), ("median_ttft_ms", 13))))
    if res.get("streams_without_done"):
        lines.append(f"NOTE: {res['streams_without_done']} streams ended on a finish_reason without data: [DONE] (counted as complete)")
    if res.get("streams_without_finish_reason"):
        lines.append(f"NOTE: {res['streams_without_finish_reason']} streams ended in data: [DONE] without a finish_reason "
                     "on any chunk (counted as complete, as vLLM's client does)")
    if res.get("usage_missing_requests"):
        lines.append(f"WARNING: {res['usage_missing_requests']} responses had no usage; their tokens were counted as chunks")
    if res.get("burst_delivered_requests"):
        lines.append(f"WARNING: {res['burst_delivered_requests']} streams were delivered in one burst after a wait: "
                     "their per-user speed measures the flush, not the decoding")
    cpu = res.get("client_cpu_per_wall")
    if metrics.client_busy(cpu):
        lines.append(f"WARNING: the client was CPU-bound ({cpu:.2f} CPU s per wall s): chunk times, per-user speeds "
                     "and TTFT include its own lag")
    lines.append("=" * 70)
    return "\n".join(lines)


def _fmt(v, width: int) -> str:
    return f"{'n/a':>{width}}" if v is None else f"{v:>{width}.1f}"
