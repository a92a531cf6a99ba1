"""Microbenchmark: adaptive-verification policy time per engine step on CPU (not a test).

    python benchmarks/policy_bench.py [--requests 256] [--k 7] [--iters 2000]

Times, per step: the full AdaptiveBudget.plan (B* from one-step-old confidences + allocation
from current ones) + observe; the pieces alone (choose_budget, numpy allocate); and the
device-style path on CPU torch (survival_torch + allocate_torch with a host-computed B*).
Prints the median and p90 in microseconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
from adaspec.spec_decode.cost_model import CostModel, CostTable, draft_grid, verify_grid
from adaspec.spec_decode.policy import AdaptiveBudget, allocate, allocate_torch, choose_budget, survival, survival_torch


def cost_model(max_tokens: int, max_requests: int) -> CostModel:
    caps = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    vs = verify_grid(max_tokens, caps)
    ds = draft_grid(max_requests, caps)
    return CostModel(CostTable(vs, [2.0 + 0.004 * s for s in vs], capture_limit=512),
                     CostTable(ds, [1.0 + 0.002 * s for s in ds], capture_limit=256))


def timeit(fn, iters: int) -> tuple[float, float]:
    for _ in range(20):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts = np.array(ts) * 1e6
    return float(np.median(ts)), float(np.percentile(ts, 90))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    R, K = args.requests, args.k
    rng = np.random.default_rng(0)
    cost = cost_model(4096, max(R, 1))
    ids = list(range(R))
    confs = [rng.uniform(0.3, 1.0, (R, K)) for _ in range(16)]
    ab = AdaptiveBudget(cost, K)
    ab.observe(ids, confs[0])
    state = {"i": 0}

    def full_step():
        c = confs[state["i"] % 16]
        state["i"] += 1
        ab.plan(ids, c, R, R)
        ab.observe(ids, c)

    a = survival(confs[1])
    b = choose_budget(a, R, R, R, cost)
    ct = torch.tensor(confs[1], dtype=torch.float32)
    rows = [
        ("AdaptiveBudget.plan + observe (numpy)", full_step),
        ("choose_budget only (numpy)", lambda: choose_budget(survival(confs[2]), R, R, R, cost)),
        ("survival + allocate (numpy)", lambda: allocate(survival(confs[3]), b)),
        ("survival_torch + allocate_torch (torch CPU)", lambda: allocate_torch(survival_torch(ct), b)),
    ]
    print(f"policy per step, {R} requests x k={K}, B*={b}, torch threads={args.threads}")
    for name, fn in rows:
        med, p90 = timeit(fn, args.iters)
        print(f"  {name:46s} median {med:8.1f} us   p90 {p90:8.1f} us")


if __name__ == "__main__":
    main()
