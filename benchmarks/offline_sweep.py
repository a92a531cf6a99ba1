"""Offline-engine sweep: arms x concurrency x repeats, without the HTTP server.

Concurrency C = closed loop with at most C requests in flight: the engine runs with
max_num_seqs=C and all prompts queued, so a new request starts as soon as one finishes.
Per run: output throughput (generated tokens / wall time of the run), per-user speed per
request ((output_tokens - 1) / (finish - first token)), median and p10 over requests, TTFT
median (from when a closed-loop client would have sent the request: when a slot freed), mean
accepted length and acceptance rate from the engine's counters, where each step's time went
(step_split), what the host did (host: CPU, load, the garbage collector's pauses, its single-thread
speed just before the point), and per run the host's single-thread speed (host_speed, at the start
and the end) and each adaptive arm's
profiled cost tables (cost_tables). After the engines load, what start-up built is frozen out of
the garbage collector's reach (--gc freeze, the default since 2026-12-02; before, a full collection
of ~100 ms or more could fall inside a point).

    python benchmarks/offline_sweep.py --model tiny --arms none,fixed:1,fixed:3,fixed:7,adaptive:7 \
        --concurrency 1,4,16,64 --num-prompts 64 --output-len 64 --temperature 0 --repeats 3 --out out.json

Where a point's time goes on the device: `--profile adaptive:7@256,none@256` runs each listed point
once more after the sweep, under torch.profiler (not one of the sweep's points, so the profiler's
cost touches no figure), and records under `profiles` its steps, wall ms per step, the kernels'
busy ms per step (the CPU ops' own time without CUDA), the busy share and the top kernels: whether
a point's steps wait on the GPU or on the host, and on which kernels. `--step-trace` records every
step of every point instead (wall ms, prompt tokens, tokens emitted, running and waiting requests,
drafted rows, verified drafts, skipped, fused: StepKinds.TRACE_FIELDS), with no profiler's cost.

Synthetic acceptance (timing only, no trained drafter): `--synthetic-acceptance P0,P1,...` runs the
speculative arms with `"method": "synthetic"` (spec_decode/synthetic.py): a DSpark drafter on random
weights proposes, acceptance per position is drawn from the curve. `--shape qwen3-8b` times a
Qwen3 shape on random weights (benchmarks/qwen3_shapes.py; load_format "dummy", token-id prompts:
the dataset's prompts as `--prompt-tokenizer` (default the embedded tiny's) tokenizes them). E.g.
the 8B shape with the code-0.6b pair's measured T=0 curve (BENCHMARKS.md, "Synthetic acceptance"):

    python benchmarks/offline_sweep.py --shape qwen3-8b --arms none,fixed:7,adaptive:7 \
        --synthetic-acceptance 0.620,0.556,0.551,0.545,0.618,0.677,0.720 --concurrency 1,16,64,256 \
        --output-len 64 --temperature 0 --repeats 2 --out frontier_synthetic_8b_T0.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

from adaspec.config import CUDAGRAPH_MODES


def _lengths_module():
    """adaspec/bench/lengths.py of this script's own tree (math and numpy only): h200_ab_synthetic.sh
    runs this script over older trees' engines, which lack it, and both sides must draw the same
    lengths."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "adaspec" / "bench" / "lengths.py"
    spec = importlib.util.spec_from_file_location("_sweep_lengths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_lengths = _lengths_module()
check_range_ratio, output_lengths = _lengths.check_range_ratio, _lengths.output_lengths


def parse_range_ratios(text: str) -> list[float]:
    """--random-range-ratio: one ratio or several, comma-separated, each in [0, 1) and none twice
    (each is a condition of the sweep) -> the ratios in the order given; a ValueError naming the
    bad entry otherwise."""
    ratios = []
    for part in str(text).split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--random-range-ratio takes numbers in [0, 1), comma-separated; got {part.strip()!r}") from None
        ratios.append(check_range_ratio(value))
    if len(set(ratios)) != len(ratios):
        raise ValueError(f"--random-range-ratio names a ratio twice: {text}")
    return ratios


def arm_config(arm: str, drafter: str | None, temperature: float, synthetic: dict | None = None) -> dict | None:
    """The arm's speculative config as `adaspec bench sweep` writes it (adaspec/bench/arms.py);
    synthetic: the "synthetic_*" keys for every speculative arm (method "synthetic"), or None."""
    from adaspec.bench.arms import ArmError, parse_arm

    try:
        cfg = parse_arm(arm).speculative_config(drafter, temperature)
    except ArmError as e:
        raise SystemExit(str(e))
    if cfg is not None and synthetic:
        cfg.update(method="synthetic", **synthetic)
    return cfg


def closed_loop_arrivals(t0: float, finish_times: list[float], n: int, c: int) -> list[float]:
    """When each of n requests (in queue order) would have been sent by a closed loop of c clients:
    the first c at t0, request j >= c when the (j - c)-th request to finish (in finishing order)
    freed its client. The engine admits queued requests first come first served as slots free, so
    this is when each one got its slot; TTFT is counted from there, not from t0 (from t0 it would
    include the wait behind the requests before it)."""
    done = sorted(finish_times)
    return [t0 if j < c else done[j - c] for j in range(n)]


def run_point(llm, prompts, params, trace: bool = False):
    """params: one SamplingParams for every prompt, or a list of one per prompt. trace: the point's
    steps one by one under `step_trace` (StepKinds.TRACE_FIELDS)."""
    eng = llm.llm_engine
    each = params if isinstance(params, list) else [params] * len(prompts)
    s0 = dict(eng.stats.as_dict())
    r0 = forward_kinds(eng.runner)
    loop_ms = host_loop_ms()  # before the point, outside its wall time
    h0 = host_sample()
    rids = []
    for i, p in enumerate(prompts):
        rids.append(f"b{time.monotonic_ns()}-{i}")
        eng.add_request(rids[-1], p, each[i])
    t0 = time.monotonic()
    first, done, ntok = {}, {}, {}
    clock = StepKinds(eng.stats, eng.scheduler, trace=trace)
    while eng.has_unfinished_requests():
        clock.start()
        outs = eng.step()
        clock.stop()
        for out in outs:
            now = time.monotonic()
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
                ntok[out.request_id] = len(out.outputs[0].token_ids)
    wall = time.monotonic() - t0
    h1 = host_sample()
    s1 = eng.stats.as_dict()
    speeds = [(ntok[r] - 1) / (done[r] - first[r]) for r in done if ntok[r] > 1 and done[r] > first[r]]
    sent = closed_loop_arrivals(t0, list(done.values()), len(rids), eng.scheduler.max_num_seqs)
    ttft = [first[r] - at for r, at in zip(rids, sent) if r in first]
    d = lambda k: s1[k] - s0[k]
    return dict(
        output_throughput=sum(ntok.values()) / wall, duration=wall, total_output_tokens=sum(ntok.values()),
        median_user_speed=statistics.median(speeds) if speeds else None,
        p10_user_speed=float(np.percentile(speeds, 10)) if speeds else None,
        median_ttft_ms=1e3 * statistics.median(ttft),
        mean_accepted_length=(1 + d("num_accepted_tokens") / d("num_drafts")) if d("num_drafts") else None,
        acceptance_rate=(d("num_accepted_tokens") / d("num_draft_tokens")) if d("num_draft_tokens") else None,
        verified_per_draft=(d("num_verified_tokens") / d("num_drafts")) if d("num_drafts") else None,
        # speculative steps that ran as CUDA graphs (the rest had a prefill chunk, logprobs or filters)
        spec_graphed_step_share=(d("num_graphed_steps") / d("num_steps")) if d("num_steps") else None,
        # a KV cache too small for the point's requests preempts some; their recompute is in the wall
        preemptions=d("num_preemptions"),
        # the target forwards of plain steps, by kind (decode graph, mixed graph, graph + eager, eager)
        forward_kinds={k: v - r0[k] for k, v in forward_kinds(eng.runner).items()},
        step_split=step_split(d, wall),
        step_kinds=clock.summary(),
        **({"step_trace": clock.trace} if trace else {}),
        policy_overhead_ms=policy_overhead_ms(eng),
        policy_overhead=policy_overhead(eng),
        policy_step_costs=policy_step_costs(eng),
        host=dict(host_load(h0, h1, wall), python_loop_ms=loop_ms),
    )


class StepKinds:
    """Wall time of the engine's steps by kind: steps that ran prompt tokens (prefill chunks, alone
    or beside decoding rows) and decode-only steps, with the tokens each kind emitted. The decode-only
    steps' tokens per ms is what benchmarks/replay_policy.py predicts from the cost tables; the
    prefill steps hold the rest of a point's time (H200 run 17: the Qwen3-8B shape's adaptive arm
    ran 36-39 of them at 256 requests, no-spec 24). Under async scheduling a step call also waits
    for the step before it, so the split is by step call, not by GPU work.

    Given the scheduler, `decode_full_batch` counts the decode-only steps that began with the batch
    full (max_num_seqs requests running), a subset of `decode`: arms compare there at the same
    rows a step, where the decode-only steps as a whole mix the full batches with the waves' tails
    (H100 run 71: ~73 rows a step for adaptive:7 against ~91 for fixed:3 at 128 requests)."""

    # --step-trace: one row per step call (counters are the stats' deltas over the call)
    TRACE_FIELDS = ("wall_ms", "prompt_tokens", "generated_tokens", "running", "waiting", "drafted_rows",
                    "verified_drafts", "draft_skipped", "mixed_fused")

    def __init__(self, stats, scheduler=None, trace: bool = False):
        self.stats = stats
        # steps, seconds, tokens
        self.kinds = {k: [0, 0.0, 0] for k in ("prefill", "decode") + (("decode_full_batch",) if scheduler else ())}
        self._t = self._prompt = self._gen = None
        self.scheduler = scheduler
        self.tracing = trace and scheduler is not None  # record each step under self.trace
        self.trace: list[list] = []
        self._at_start: tuple = ()
        self._full = False  # the step being timed began with max_num_seqs requests running

    def _counters(self) -> tuple:
        s = self.stats
        return (s.num_drafts, s.num_verified_tokens, s.num_steps_draft_skipped, s.num_mixed_steps_fused)

    def start(self) -> None:
        if self.scheduler is not None:  # before the clock starts: not timed
            running = len(self.scheduler.running)
            self._full = running >= self.scheduler.max_num_seqs
            if self.tracing:
                self._at_start = (running, len(self.scheduler.waiting), *self._counters())
        self._t, self._prompt, self._gen = time.perf_counter(), self.stats.num_prompt_tokens, self.stats.num_generated_tokens

    def stop(self) -> None:
        dt = time.perf_counter() - self._t
        prompt, gen = self.stats.num_prompt_tokens - self._prompt, self.stats.num_generated_tokens - self._gen
        names = ("prefill",) if prompt > 0 else ("decode", "decode_full_batch") if self._full else ("decode",)
        for name in names:
            kind = self.kinds[name]
            kind[0] += 1
            kind[1] += dt
            kind[2] += gen
        if self.tracing:
            running, waiting, *before = self._at_start
            deltas = [after - b for after, b in zip(self._counters(), before)]
            self.trace.append([round(1e3 * dt, 3), prompt, gen, running, waiting, *deltas])

    def summary(self) -> dict:
        out = {}
        for name, (n, sec, tok) in self.kinds.items():
            out[name] = dict(steps=n, ms_per_step=round(1e3 * sec / n, 3) if n else None, tokens=tok,
                             tokens_per_ms=round(tok / (1e3 * sec), 3) if sec > 0 else None)
        return out


class GcPauses:
    """The garbage collector's collections and the time they stood the process still, per
    generation, from start() on. A full collection walks every tracked object: with several
    engines loaded (the interleaved sweep) that is a pause of 100 ms or more, inside a point that
    lasts ~1.5 s at C = 256 on the H200, so each point records its own (host["gc"]) and the sweep
    freezes what start-up built (--gc freeze, freeze_startup_heap). The callback is installed by
    start() (the sweep's main), not on import, and keeps its own clock: a test that fakes
    time.perf_counter in a process that imported this module is not fed collections' ticks."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.started = False
        self._clock = time.perf_counter
        self._t = 0.0

    def start(self) -> None:
        if not self.started:
            gc.callbacks.append(self._callback)
            self.started = True

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = self._clock()
        else:
            g = info["generation"]
            self.collections[g] += 1
            self.seconds[g] += self._clock() - self._t

    def sample(self) -> tuple | None:
        """The counters now, or None before start()."""
        return (tuple(self.collections), tuple(self.seconds)) if self.started else None

    @staticmethod
    def since(g0: tuple | None, g1: tuple | None) -> dict | None:
        if g0 is None or g1 is None:
            return None
        return {"collections": [b - a for a, b in zip(g0[0], g1[0])],
                "ms": [round(1e3 * (b - a), 2) for a, b in zip(g0[1], g1[1])]}


GC_PAUSES = GcPauses()


def freeze_startup_heap() -> None:
    """Move every object alive now (the loaded engines: modules, weights' wrappers, graphs) out of
    the collector's reach, as `adaspec serve` does after start-up: later full collections walk only
    what the points allocate. Undone with gc.unfreeze() before an engine is freed (frozen objects
    are never collected, and an engine holds reference cycles)."""
    gc.collect()
    gc.freeze()


def host_sample() -> tuple:
    """(this process's CPU seconds, the machine's busy and total CPU jiffies or None, 1-minute load,
    the collector's counters)."""
    cpu = time.process_time()
    busy = total = None
    try:  # Linux: the machine's CPU time, all processes (fields: user nice system idle iowait ...)
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        total, busy = sum(f), sum(f) - f[3] - (f[4] if len(f) > 4 else 0)
    except (OSError, ValueError):
        pass
    return cpu, busy, total, os.getloadavg()[0] if hasattr(os, "getloadavg") else None, GC_PAUSES.sample()


def host_speed() -> dict | None:
    """conditions.host_speed (the host's single-thread speed, 10-30 ms to measure), or None over
    older trees that lack it (h200_ab_synthetic.sh runs this script over older trees' engines)."""
    try:
        from adaspec.bench.conditions import host_speed as measure
    except ImportError:
        return None
    return measure()


def host_loop_ms() -> float | None:
    """The host's single-thread speed just before a point: H200 run 20's sweep measured 5.5 ms at
    its start and 2.4 ms at its end on one machine, and its no-spec points at 256 requests, whose
    decode steps wait on the host, lasted 1.0-1.3x the fastest repeat; per point, a slow repeat
    shows whether the host was slow then."""
    speed = host_speed()
    return speed["python_loop_ms"] if speed else None


def host_load(h0: tuple, h1: tuple, wall: float) -> dict:
    """What the host did during a point, to tell a slow host from a slow engine when two runs
    differ (H200 run 15: the engine's host bookkeeping was 1.5-2x run 14's in every arm, cause
    unknown): this process's CPU seconds per wall second (~1 for a busy engine loop, plus its
    other threads), the machine's busy CPUs (all processes; another process competing shows as
    busy CPUs well above this process's share), the 1-minute load average at the end, and the
    garbage collector's collections and pause ms per generation during the point (GcPauses)."""
    out = {"process_cpu_per_wall": round((h1[0] - h0[0]) / wall, 3) if wall > 0 else None,
           "machine_busy_cpus": None, "loadavg_1m": round(h1[3], 2) if h1[3] is not None else None,
           "gc": GcPauses.since(h0[4], h1[4])}
    if h0[1] is not None and h1[1] is not None and h1[2] > h0[2]:
        out["machine_busy_cpus"] = round((h1[1] - h0[1]) / (h1[2] - h0[2]) * (os.cpu_count() or 1), 2)
    return out


def prompts_per_point(num_prompts: int | None, per_concurrency: int, concurrency: int, min_prompts: int = 8) -> int:
    """--num-prompts when given, else per_concurrency waves of C prompts, at least min_prompts."""
    if num_prompts is not None:
        if num_prompts < 1:
            raise SystemExit(f"--num-prompts must be at least 1, got {num_prompts}")
        return num_prompts
    if per_concurrency < 1:
        raise SystemExit(f"--prompts-per-concurrency must be at least 1, got {per_concurrency}")
    if min_prompts < 1:
        raise SystemExit(f"--min-prompts must be at least 1, got {min_prompts}")
    return max(min_prompts, per_concurrency * concurrency)


def interleaved_kv_gib(asked: float, num_engines: int, free_bytes: int, weight_bytes: int = 0,
                       share: float = 0.6) -> float:
    """KV cache GiB per engine for an interleaved sweep: `asked`, or less when num_engines of it and
    of the engine's weights (weight_bytes: target and drafter) would take more than `share` of the
    device's free memory (the rest holds their CUDA graphs and activations). H100 run 56: five
    engines of 16 GiB ran out of memory on an 80 GB card, the fifth engine's cache failing after four
    had loaded; H100 run 74: three Qwen3-8B engines (15.3 GiB of weights each) with 15.5 GiB of cache
    each, sized before the weights counted. Rounded down to 0.5 GiB; an error naming the numbers when
    not even 0.5 GiB an engine fits."""
    if asked <= 0 or num_engines < 1:
        raise SystemExit(f"--kv-cache-gib must be positive and there must be an arm, got {asked} and {num_engines}")
    fit = int((share * free_bytes / num_engines - weight_bytes) / 2**30 * 2) / 2
    if fit < 0.5:
        raise SystemExit(f"{num_engines} interleaved engines do not fit: {free_bytes / 2**30:.1f} GiB free on the "
                         f"device, {weight_bytes / 2**30:.1f} GiB of weights an engine; sweep fewer arms at once "
                         "or without --interleave")
    return min(asked, fit)


def _qwen3_shapes():
    """benchmarks/qwen3_shapes.py (beside this script, which may run from any directory)."""
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import qwen3_shapes

    return qwen3_shapes


def engine_weight_bytes(shape: str | None, model: str, drafter: str | None) -> int:
    """What one engine's weights take: the --shape's parameters in bf16 (the whole shape's:
    --shape-overrides that shrink it are not counted, an upper bound), or the model's (and a
    drafter directory's) safetensors files; 0 where neither is known (an embedded name)."""
    from pathlib import Path

    if shape:
        return 2 * _qwen3_shapes().param_count(shape)
    return sum(f.stat().st_size for d in (model, drafter) if d and Path(d).is_dir()
               for f in Path(d).glob("*.safetensors"))


def _policy(eng):
    """The engine's speculative policy, or None (no speculation)."""
    return getattr(getattr(eng, "spec", None), "policy", None)


def policy_step_costs(eng) -> dict | None:
    """The adaptive policy's measured tokens per request per ms per step kind and batch-size bucket at
    the end of a point (spec_decode/step_costs.py); None where it does not measure them."""
    costs = getattr(_policy(eng), "step_costs", None)
    return None if costs is None else costs.snapshot()


def policy_overhead_ms(eng) -> float | None:
    """The adaptive policy's step overhead at the end of a point (ms added to its cost tables);
    None for an arm without one (no speculation, fixed k)."""
    overhead = getattr(_policy(eng), "overhead", None)
    return None if overhead is None else round(overhead.value, 3)


def policy_overhead(eng) -> dict | None:
    """The measured step overhead's state at the end of a point (step_overhead.StepOverhead.snapshot:
    the value priced, its signed average, the samples, how many were negative, the per-sample-floored
    average); None where the overhead is not measured."""
    overhead = getattr(_policy(eng), "overhead", None)
    return overhead.snapshot() if overhead is not None and overhead.measured else None


def step_split(d, wall: float) -> dict:
    """Where a point's steps went: counts, and ms per step of the engine's own timers (the graphed
    speculative step's replays + read back; the eager one's draft / verify / sample; bookkeeping)
    beside the wall time per step, so a step slower than its cost tables says shows where."""
    n = d("num_steps")
    ms = lambda k: round(1e3 * d(k) / n, 3) if n else None
    return dict(steps=n, draft_skipped=d("num_steps_draft_skipped"), graphed=d("num_graphed_steps"),
                # steps with prompt chunks run as one forward (adaptive_verification_mixed_steps "fused")
                mixed_fused=d("num_mixed_steps_fused"),
                wall_ms=round(1e3 * wall / n, 3) if n else None, graphed_ms=ms("time_graphed"),
                draft_ms=ms("time_draft"), verify_ms=ms("time_verify"), sample_ms=ms("time_sample"),
                bookkeeping_ms=ms("time_bookkeeping"))


def parse_profile_points(text: str | None, arms: list[str], concs: list[int]) -> list[tuple[str, int]]:
    """--profile ARM@C,...: the points to profile, each one the sweep measures; a clear exit otherwise."""
    points = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        arm, sep, c = item.strip().rpartition("@")
        if not sep or not c.isdigit():
            raise SystemExit(f"--profile {item.strip()!r}: write ARM@CONCURRENCY, e.g. adaptive:7@256")
        if arm not in arms or int(c) not in concs:
            raise SystemExit(f"--profile {item.strip()!r}: not a point of this sweep (arms {','.join(arms)}; "
                             f"concurrency {','.join(map(str, concs))})")
        points.append((arm, int(c)))
    return points


def profiled_point(llm, prompts, params, on_device: bool, top: int = 15) -> dict:
    """run_point once more under torch.profiler: where the point's time went. -> step_profile's
    summary (steps, wall and kernel-busy ms per step, top kernels) with the busy share of the wall
    time and what the profiled run made (the profiler slows the host: not a measurement to compare)."""
    from adaspec.train.step_profile import summarize

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_device else [])
    with torch.profiler.profile(activities=acts) as prof:
        res = run_point(llm, prompts, params)
        if on_device:
            torch.cuda.synchronize()
    steps = res["step_split"]["steps"] or 1
    out = summarize(prof.key_averages(), steps, res["duration"], on_device=on_device, top=top)
    out["busy_share"] = round(out["timed_ms_per_step"] / out["wall_ms_per_step"], 3) if out["wall_ms_per_step"] else None
    out["profiled_output_throughput"] = res["output_throughput"]
    out["step_kinds"] = res["step_kinds"]
    return out


def forward_kinds(runner) -> dict:
    return {k: getattr(runner, f"num_{k}_steps", 0) for k in ("graph", "mixed_graph", "split", "eager")}


def speculative_config_extra(text: str | None) -> dict:
    """--speculative-config-extra: a JSON object, or a clear exit naming what is wrong."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--speculative-config-extra is not valid JSON: {e}") from None
    if not isinstance(extra, dict):
        raise SystemExit(f"--speculative-config-extra must be a JSON object, got {text!r}")
    return extra


def synthetic_keys(args) -> dict | None:
    if not args.synthetic_acceptance:
        return None
    try:
        curve = [float(x) for x in args.synthetic_acceptance.split(",")]
    except ValueError:
        raise SystemExit(f"--synthetic-acceptance takes comma-separated probabilities, got {args.synthetic_acceptance!r}")
    keys = {"synthetic_acceptance": curve, "synthetic_confidence_noise": args.synthetic_confidence_noise}
    if args.synthetic_drafter:
        keys["synthetic_drafter"] = json.loads(args.synthetic_drafter)
    return keys


def shape_model_dir(name: str, overrides: str | None) -> str:
    """A config.json-only directory of a Qwen3 shape (weights: load_format "dummy")."""
    import tempfile

    shapes = _qwen3_shapes()
    SHAPES, write_shape = shapes.SHAPES, shapes.write_shape
    if name not in SHAPES:
        raise SystemExit(f"unknown --shape {name!r}; known: {', '.join(SHAPES)}")
    d = write_shape(name, tempfile.mkdtemp(prefix="adaspec-shape-"))
    if overrides:  # e.g. fewer layers, for a CPU smoke test of the same code path
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(json.loads(overrides))
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(d)


def sweep_arms_one_at_a_time(arms: list[str], load, measure_arm, freeze: bool = False) -> None:
    """Load, measure and free each arm in turn. The engine sizes its KV cache from the GPU memory
    that is free when it loads, so the previous arm's engine (weights, KV cache, CUDA graphs' pools)
    must be gone first: dropping the name was not enough (the engine holds reference cycles), and in
    H200 run 16 the third arm of the Qwen3-8B sweep got 1,531 KV blocks, fewer than one request
    needs. load(arm) -> (llm, *rest); measure_arm(arm, llm, *rest). freeze: the collector ignores
    each arm's start-up heap while it is measured (freeze_startup_heap)."""
    for arm in arms:
        loaded = list(load(arm))
        if freeze:
            freeze_startup_heap()
        try:
            measure_arm(arm, *loaded)
        finally:
            gc.unfreeze()  # the engine's objects must be collectable again to be freed
        engine = loaded[0].llm_engine
        loaded.clear()
        # getattr: h200_ab_synthetic.sh runs this script over older trees' engines too
        getattr(engine, "release_cuda_graphs", lambda: None)()  # the graphs' private memory pools
        getattr(engine, "shutdown", lambda: None)()  # tensor-parallel workers, if any
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # back to the driver, where the next engine's sizing looks


def main() -> None:
    GC_PAUSES.start()
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--shape", default=None, help="time a Qwen3 shape on random weights (qwen3_shapes.py), "
                    "instead of --model: load_format dummy, token-id prompts")
    ap.add_argument("--shape-overrides", default=None, metavar="JSON", help="edit the shape's config.json")
    ap.add_argument("--prompt-tokenizer", default="tiny", help="with --shape: the tokenizer that turns the "
                    "dataset's prompts into token ids (ids must lie in the shape's vocabulary)")
    ap.add_argument("--synthetic-acceptance", default=None, metavar="P0,P1,...",
                    help="speculative arms use method synthetic with this conditional acceptance per position "
                         "(timing only)")
    ap.add_argument("--synthetic-confidence-noise", type=float, default=0.05)
    ap.add_argument("--synthetic-drafter", default=None, metavar="JSON",
                    help='the stand-in drafter\'s shape, e.g. {"num_layers": 1}')
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--arms", default="none,fixed:1,fixed:3,fixed:7,adaptive:7")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts per point (default: --prompts-per-concurrency x concurrency, at least 8)")
    ap.add_argument("--prompts-per-concurrency", type=int, default=2,
                    help="without --num-prompts: each point sends this many waves of C prompts; at 2 a point at "
                         "C = 256 lasts under a second on the H200, so its ramps weigh as much as its steady state")
    ap.add_argument("--min-prompts", type=int, default=8,
                    help="without --num-prompts: at least this many prompts per point. At one request 8 prompts of "
                         "64 tokens put the per-user speed's spread over repeats at 8-19%% on the code-0.6b pair at "
                         "T = 1 (H200 run 41, H100 runs 50-51), more than the gaps it decides; 64 costs seconds there")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--random-range-ratio", default="0",
                    help="spread each request's max_tokens over [L(1 - r), L(1 + r)] (adaspec/bench/lengths.py), the "
                         "same lengths for every arm at a point; default 0: every request asks for --output-len. "
                         "Several, comma-separated (e.g. 0,0.5): each is a condition of its own, measured with the "
                         "same engines (one build, one start-up), each row naming its ratio")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dataset", default="eval-code")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--speculative-config-extra", metavar="JSON", default=None,
                    help='keys merged into every speculative arm\'s config (as `adaspec bench sweep`\'s), e.g. '
                         '\'{"adaptive_verification_step_overhead_ms": "measured"}\'')
    ap.add_argument("--cudagraph-mode", default=None, choices=list(CUDAGRAPH_MODES),
                    help="the engine's cudagraph_mode (default: the engine's)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", metavar="ARM@C,...", default=None,
                    help="after the sweep, run each listed point once more under torch.profiler (not "
                         "counted among the points) and record where its time went under `profiles`")
    ap.add_argument("--step-trace", action="store_true",
                    help="record every step of every point under the row's step_trace: wall ms, prompt tokens, "
                         "tokens emitted, running and waiting requests at its start, drafted rows, verified "
                         "drafts, draft skipped, mixed step fused (step_trace_fields); where a point's steps "
                         "went, one by one")
    ap.add_argument("--gc", choices=("freeze", "as-is"), default="freeze",
                    help="freeze: after the engines load, move what start-up built out of the garbage collector's "
                         "reach (as `adaspec serve` does), so that a full collection inside a point walks only what "
                         "the points allocated; as-is: leave the collector alone (runs before 2026-12-02 did). "
                         "Every point records its collections and their pauses (host.gc)")
    ap.add_argument("--interleave", action="store_true",
                    help="load every arm's engine at once and rotate the arms' order each repeat (needs "
                         "memory for all of them; give --kv-cache-gib so each gets the same KV cache)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV cache per engine (default: the engine's, a share of free memory at load time)")
    args = ap.parse_args()
    try:
        ratios = parse_range_ratios(args.random_range_ratio)
    except ValueError as e:
        ap.error(str(e))
    # the JSON's args: one ratio as a number (as before), several as a list
    args.random_range_ratio = ratios[0] if len(ratios) == 1 else ratios
    if args.threads:
        torch.set_num_threads(args.threads)

    from adaspec import LLM, SamplingParams
    from adaspec.train.prompts import load_prompt_set

    texts = load_prompt_set(args.dataset)
    concs = [int(c) for c in args.concurrency.split(",")]
    synthetic = synthetic_keys(args)
    spec_extra = speculative_config_extra(args.speculative_config_extra)
    engine_args = {"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else {}
    if args.shape:
        from adaspec.models.tokenizer import Tokenizer
        from adaspec.models.registry import resolve_model_path

        args.model = shape_model_dir(args.shape, args.shape_overrides)
        engine_args.update(load_format="dummy", skip_tokenizer_init=True)
        ptok = Tokenizer.from_dir(resolve_model_path(args.prompt_tokenizer))
        shape_prompts = [ptok.encode(t)[-args.max_prompt_tokens:] for t in texts]
    rows, label = [], None
    host_speed_start = host_speed()  # before the engines load: a slower host CPU, not a slower engine
    from adaspec.bench.checkpoint_id import checkpoints

    # which weights: every build on the GPU machine is written to the same path (None for --shape's dummy weights)
    ckpt = checkpoints(None if args.shape else args.model, args.drafter)
    arms = args.arms.split(",")
    if args.interleave and args.kv_cache_gib and args.device != "cpu" and torch.cuda.is_available():
        asked = args.kv_cache_gib
        args.kv_cache_gib = interleaved_kv_gib(asked, len(arms), torch.cuda.mem_get_info()[0],
                                               engine_weight_bytes(args.shape, args.model, args.drafter))
        if args.kv_cache_gib < asked:  # (the JSON's args record the size that ran)
            print(f"--kv-cache-gib {asked:g} for each of {len(arms)} engines does not fit this device: "
                  f"{args.kv_cache_gib:g} GiB each", flush=True)
    kv = {"kv_cache_memory": int(args.kv_cache_gib * 2**30)} if args.kv_cache_gib else {}
    # label: "synthetic acceptance: timing only" when set; cost_tables: each adaptive arm's profiled
    # tables (ms per verified token count and per drafted request count), what the policy prices steps
    # with by default (plus the graphs' padding, which the arm's graph sizes give; a step overhead or
    # measured step costs, when configured, are not saved), so its choices can be checked after the run
    # (H200 run 16: on the 8B shape at C = 64 adaptive verified more than paid, and the tables had
    # stayed on the machine)
    state = {"label": None, "cost_tables": {}, "profiles": {}}
    to_profile = parse_profile_points(args.profile, arms, concs)

    def load(arm):
        cfg = arm_config(arm, args.drafter, args.temperature, synthetic)
        if cfg is not None:
            cfg.update(spec_extra)
        llm = LLM(args.model, device=args.device, max_num_seqs=max(concs), speculative_config=cfg,
                  **engine_args, **kv)
        # "synthetic acceptance: timing only" when the arm's acceptance follows the configured curve
        arm_label = llm.llm_engine.stats.synthetic_acceptance
        state["label"] = state["label"] or arm_label
        tables = getattr(getattr(llm.llm_engine, "spec", None), "cost_model", None)
        if tables is not None:
            state["cost_tables"][arm] = tables.to_dict()
        if args.shape:
            prompts = shape_prompts
        else:
            tok = llm.get_tokenizer()
            prompts = [tok.encode(t)[-args.max_prompt_tokens:] for t in texts]
        return llm, arm_label, prompts

    warmed = set()

    def point_inputs(prompts, c, r, ratio):
        """The prompts and sampling parameters of point (C, repeat, range ratio): the same for every
        arm (and the same prompts for every ratio)."""
        n = prompts_per_point(args.num_prompts, args.prompts_per_concurrency, c, args.min_prompts)
        # the point's lengths depend on (C, repeat) only: every arm gets the same ones
        params = [SamplingParams(temperature=args.temperature, max_tokens=n_tok, ignore_eos=True, seed=None)
                  for n_tok in output_lengths(n, args.output_len, ratio, seed=100_003 * r + c)]
        return [prompts[(r * n + i) % len(prompts)] for i in range(n)], params

    def measure(arm, llm, arm_label, prompts, c, r, ratio):
        llm.llm_engine.scheduler.max_num_seqs = c  # closed loop of C in flight
        sel, params = point_inputs(prompts, c, r, ratio)
        if (arm, c) not in warmed:
            # warm-up at this concurrency (C prompts, 8 tokens): the first prefill and decode of a new
            # batch shape compile kernels (Triton tiles, torch.compile guards), which must not be timed
            warm = [prompts[i % len(prompts)] for i in range(c)]
            run_point(llm, warm, SamplingParams(temperature=args.temperature, max_tokens=8, ignore_eos=True))
            warmed.add((arm, c))
            if args.gc == "freeze":  # what the warm-up built (compiled kernels' caches, guards) too
                gc.freeze()
        torch.manual_seed(r)
        res = run_point(llm, sel, params, trace=args.step_trace)
        rows.append(dict(arm=arm, concurrency=c, repeat=r, random_range_ratio=ratio, num_prompts=len(sel), **res,
                         **({"synthetic_acceptance": arm_label} if arm_label else {})))
        if args.out:  # after every point: a run cut short keeps what it measured
            label = state["label"]
            with open(args.out, "w") as fh:
                json.dump(dict(args=vars(args), **({"synthetic_acceptance": label} if label else {}),
                               host_speed={"start": host_speed_start}, checkpoints=ckpt, rows=rows,
                               cost_tables=state["cost_tables"], partial=True), fh, indent=1)
        print(f"{arm:<12} c={c:<4} r={r}{f' rr={ratio:g}' if len(ratios) > 1 else ''} "
              f"out tok/s={res['output_throughput']:8.1f} "
              f"user tok/s={res['median_user_speed'] or 0:7.1f} tau={res['mean_accepted_length'] or 0:.2f}"
              + (f" preemptions={res['preemptions']}" if res["preemptions"] else ""), flush=True)

    def profile(arm, llm, arm_label, prompts):
        for c in [c for a, c in to_profile if a == arm]:
            llm.llm_engine.scheduler.max_num_seqs = c
            # repeat 0's at the first ratio: the profile explains the points measured with them
            sel, params = point_inputs(prompts, c, 0, ratios[0])
            torch.manual_seed(0)
            on_device = torch.cuda.is_available() and args.device != "cpu"
            got = profiled_point(llm, sel, params, on_device)
            state["profiles"][f"{arm}@{c}"] = got
            print(f"profile {arm}@{c}: {got['steps']} steps, {got['wall_ms_per_step']:.2f} ms wall and "
                  f"{got['timed_ms_per_step']:.2f} ms of {got['timer']} per step (busy {got['busy_share']})", flush=True)

    if args.interleave:
        # every arm's engine stays loaded; each repeat visits the arms in a rotated order, so no arm
        # is always the first to run a concurrency (the order effects a one-arm-at-a-time sweep has)
        loaded = {arm: load(arm) for arm in arms}
        if args.gc == "freeze":
            freeze_startup_heap()
        try:
            for r in range(args.repeats):
                for ratio in ratios:
                    for c in concs:
                        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
                            measure(arm, *loaded[arm], c, r, ratio)
            for arm in arms:
                profile(arm, *loaded[arm])
        finally:
            gc.unfreeze()
        del loaded
    else:
        def measure_arm(arm, llm, arm_label, prompts):
            for ratio in ratios:
                for c in concs:
                    for r in range(args.repeats):
                        measure(arm, llm, arm_label, prompts, c, r, ratio)
            profile(arm, llm, arm_label, prompts)

        sweep_arms_one_at_a_time(arms, load, measure_arm, freeze=args.gc == "freeze")
    label = state["label"]
    # summary: mean +- std over repeats
    print()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else platform.machine() + " CPU"
    if label:
        print(f"*** {label}: speculative arms drew acceptance from {args.synthetic_acceptance} ***")
    spread = f" random_range_ratio={','.join(f'{x:g}' for x in ratios)}" if any(ratios) else ""
    from adaspec.sample import kernels

    on = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"  # as `dev`
    sampler, markov_loop = kernels.in_use(on), kernels.markov_loop_in_use(on)
    from adaspec.models.fused import kv_write_in_use

    kv_write = kv_write_in_use(on)  # (ADASPEC_FUSED_KV_WRITE)
    print(f"model={args.shape or args.model} drafter={args.drafter or 'default'} device={dev} "
          f"threads={torch.get_num_threads()} T={args.temperature} output_len={args.output_len}{spread} "
          f"repeats={args.repeats} sampler={sampler} markov_loop={markov_loop} kv_write={kv_write}")
    w = max(12, *(len(a) + 1 for a in arms))  # the arm column, as wide as the longest name
    rr = len(ratios) > 1  # a ratio column only when the sweep had several
    print(f"{'arm':<{w}}" + (f"{'rr':>5}" if rr else "") + f"{'conc':>5}{'out tok/s':>18}{'user tok/s (med)':>20}"
          f"{'tau':>7}{'verified/draft':>16}")
    summary = []
    f = lambda pts, k: [p[k] for p in pts if p[k] is not None]
    m = lambda xs: (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (None, None)
    fmt = lambda t: f"{t[0]:.1f} ± {t[1]:.1f}" if t[0] is not None else "-"
    for arm, ratio, c in ((a, x, c) for a in args.arms.split(",") for x in ratios for c in concs):
        pts = [r for r in rows if r["arm"] == arm and r["concurrency"] == c and r["random_range_ratio"] == ratio]
        thr, usr = m(f(pts, "output_throughput")), m(f(pts, "median_user_speed"))
        tau, ver = m(f(pts, "mean_accepted_length")), m(f(pts, "verified_per_draft"))
        summary.append(dict(arm=arm, concurrency=c, random_range_ratio=ratio, output_throughput=thr,
                            median_user_speed=usr, mean_accepted_length=tau, verified_per_draft=ver))
        print(f"{arm:<{w}}" + (f"{ratio:>5g}" if rr else "") + f"{c:>5}{fmt(thr):>18}{fmt(usr):>20}"
              f"{(tau[0] or 0):>7.2f}{(ver[0] or 0):>16.2f}")
    if args.out:
        from adaspec.bench.conditions import engine_commit

        commit = engine_commit()  # $ADASPEC_COMMIT when set: the GPU machine's copied .git is stale
        with open(args.out, "w") as fh:
            json.dump(dict(args=vars(args), **({"synthetic_acceptance": label} if label else {}), device=dev,
                           torch=torch.__version__, commit=commit, checkpoints=ckpt, sampler=sampler,
                           markov_loop=markov_loop, kv_write=kv_write,
                           host_speed={"start": host_speed_start, "end": host_speed()},
                           cost_tables=state["cost_tables"], rows=rows, summary=summary,
                           **({"profiles": state["profiles"]} if to_profile else {}),
                           **({"step_trace_fields": list(StepKinds.TRACE_FIELDS)} if args.step_trace else {})),
                      fh, indent=1)


if __name__ == "__main__":
    main()
