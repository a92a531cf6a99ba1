"""Device-to-host syncs of one engine step, by where they happen (torch's sync debug mode, plus
the event waits of async scheduling, which that mode does not see: decode_bench.step_sync_sites),
for the plain, fixed-k, adaptive and fused-adaptive arms on the tiny pair (CUDA), in two
workloads: decode-only steps, and steps while a new request arrives before each (prompt chunks
beside the decoding rows: the fused mode's plain chunk steps and its fall-throughs). Prints a
table and writes $OUT/step_syncs.json (default ./out).

    python3 benchmarks/step_syncs.py
"""
from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaspec import LLM, SamplingParams  # noqa: E402
from decode_bench import step_sync_sites  # noqa: E402


def main() -> int:
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    adaptive = {"method": "dspark", "num_speculative_tokens": 7, "enable_adaptive_verification": True}
    arms = {"none": None,
            "fixed:7": {"method": "dspark", "num_speculative_tokens": 7},
            "adaptive:7": adaptive,
            "adaptive-fused:7": {**adaptive, "adaptive_verification_mixed_steps": "fused"}}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "arms": {}}
    for arm, spec in arms.items():
        eng = LLM("tiny", speculative_config=spec, max_num_seqs=32, device="cuda").llm_engine
        g = torch.Generator().manual_seed(0)

        def add(name: str) -> None:
            ids = torch.randint(10, 8000, (40,), generator=g).tolist()
            eng.add_request(name, ids, SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True,
                                                      seed=len(eng.requests)))

        for i in range(8):
            add(f"{arm}-{i}")
        for _ in range(4):
            eng.step()
        rows = {}
        for workload in ("decode", "arrivals"):
            counts = []
            for i in range(5):
                if workload == "arrivals":  # a new prompt before each step: chunk steps beside the decodes
                    add(f"{arm}-new-{i}")
                counts.append(step_sync_sites(eng))
            sites = collections.Counter(s for c in counts for s in c)
            rows[workload] = {"syncs_per_step": [len(c) for c in counts], "sites": dict(sites)}
            print(f"{arm:<17} {workload:<9} syncs per step {[len(c) for c in counts]}  sites: {dict(sites)}",
                  flush=True)
        result["arms"][arm] = rows
    (out / "step_syncs.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
