"""Offline-engine sweep: arms x concurrency x repeats, without the HTTP server.

Concurrency C = closed loop with at most C requests in flight: the engine runs with
max_num_seqs=C and all prompts queued, so a new request starts as soon as one finishes.
Per run: output throughput (generated tokens / wall time of the run), per-user speed per
request ((output_tokens - 1) / (finish - first token)), median and p10 over requests, TTFT
median, mean accepted length and acceptance rate from the engine's counters.

    python benchmarks/offline_sweep.py --model tiny --arms none,fixed:1,fixed:3,fixed:7,adaptive:7 \
        --concurrency 1,4,16,64 --num-prompts 64 --output-len 64 --temperature 0 --repeats 3 --out out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
import torch


def arm_config(arm: str, drafter: str | None, temperature: float) -> dict | None:
    if arm == "none":
        return None
    kind, k = arm.split(":")
    cfg = {"method": "dspark", "num_speculative_tokens": int(k),
           "draft_sample_method": "probabilistic" if temperature > 0 else "greedy"}
    if drafter:
        cfg["model"] = drafter
    if kind == "adaptive":
        cfg["enable_adaptive_verification"] = True
    elif kind != "fixed":
        raise SystemExit(f"unknown arm {arm!r}: use none, fixed:K or adaptive:K")
    return cfg


def run_point(llm, prompts, params):
    eng = llm.llm_engine
    s0 = dict(eng.stats.as_dict())
    for i, p in enumerate(prompts):
        eng.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    t0 = time.monotonic()
    first, done, ntok = {}, {}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            now = time.monotonic()
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
                ntok[out.request_id] = len(out.outputs[0].token_ids)
    wall = time.monotonic() - t0
    s1 = eng.stats.as_dict()
    speeds = [(ntok[r] - 1) / (done[r] - first[r]) for r in done if ntok[r] > 1 and done[r] > first[r]]
    ttft = [first[r] - t0 for r in first]  # all queued at t0: includes queueing, as a closed loop would
    d = lambda k: s1[k] - s0[k]
    return dict(
        output_throughput=sum(ntok.values()) / wall, duration=wall, total_output_tokens=sum(ntok.values()),
        median_user_speed=statistics.median(speeds) if speeds else None,
        p10_user_speed=float(np.percentile(speeds, 10)) if speeds else None,
        median_ttft_ms=1e3 * statistics.median(ttft),
        mean_accepted_length=(1 + d("num_accepted_tokens") / d("num_drafts")) if d("num_drafts") else None,
        acceptance_rate=(d("num_accepted_tokens") / d("num_draft_tokens")) if d("num_draft_tokens") else None,
        verified_per_draft=(d("num_verified_tokens") / d("num_drafts")) if d("num_drafts") else None,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--arms", default="none,fixed:1,fixed:3,fixed:7,adaptive:7")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 2 x concurrency, at least 8")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dataset", default="eval-code")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from adaspec import LLM, SamplingParams
    from adaspec.train.prompts import load_prompt_set

    texts = load_prompt_set(args.dataset)
    concs = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for arm in args.arms.split(","):
        cfg = arm_config(arm, args.drafter, args.temperature)
        llm = LLM(args.model, device=args.device, max_num_seqs=max(concs), speculative_config=cfg)
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t)[-args.max_prompt_tokens:] for t in texts]
        for c in concs:
            llm.llm_engine.scheduler.max_num_seqs = c  # closed loop of C in flight
            n = args.num_prompts or max(8, 2 * c)
            params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=None)
            run_point(llm, prompts[:2], SamplingParams(temperature=args.temperature, max_tokens=4, ignore_eos=True))  # warm-up
            for r in range(args.repeats):
                sel = [prompts[(r * n + i) % len(prompts)] for i in range(n)]
                torch.manual_seed(r)
                res = run_point(llm, sel, params)
                rows.append(dict(arm=arm, concurrency=c, repeat=r, num_prompts=n, **res))
                if args.out:  # after every point: a run cut short keeps what it measured
                    with open(args.out, "w") as fh:
                        json.dump(dict(args=vars(args), rows=rows, partial=True), fh, indent=1)
                print(f"{arm:<12} c={c:<4} r={r} out tok/s={res['output_throughput']:8.1f} "
                      f"user tok/s={res['median_user_speed'] or 0:7.1f} tau={res['mean_accepted_length'] or 0:.2f}",
                      flush=True)
        del llm
    # summary: mean +- std over repeats
    print()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else platform.machine() + " CPU"
    print(f"model={args.model} drafter={args.drafter or 'default'} device={dev} threads={torch.get_num_threads()} "
          f"T={args.temperature} output_len={args.output_len} repeats={args.repeats}")
    print(f"{'arm':<12}{'conc':>5}{'out tok/s':>18}{'user tok/s (med)':>20}{'tau':>7}{'verified/draft':>16}")
    summary = []
    for arm in args.arms.split(","):
        for c in concs:
            pts = [r for r in rows if r["arm"] == arm and r["concurrency"] == c]
            f = lambda k: [p[k] for p in pts if p[k] is not None]
            m = lambda xs: (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (None, None)
            thr, usr, tau, ver = m(f("output_throughput")), m(f("median_user_speed")), m(f("mean_accepted_length")), m(f("verified_per_draft"))
            summary.append(dict(arm=arm, concurrency=c, output_throughput=thr, median_user_speed=usr,
                                mean_accepted_length=tau, verified_per_draft=ver))
            fmt = lambda t: f"{t[0]:.1f} ± {t[1]:.1f}" if t[0] is not None else "-"
            print(f"{arm:<12}{c:>5}{fmt(thr):>18}{fmt(usr):>20}{(tau[0] or 0):>7.2f}{(ver[0] or 0):>16.2f}")
    if args.out:
        from adaspec.bench.conditions import engine_commit

        commit = engine_commit()  # $ADASPEC_COMMIT when set: the GPU machine's copied .git is stale
        with open(args.out, "w") as fh:
            json.dump(dict(args=vars(args), device=dev, torch=torch.__version__, commit=commit, rows=rows,
                           summary=summary), fh, indent=1)


if __name__ == "__main__":
    main()
