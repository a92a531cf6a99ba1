"""Where a ruled or structured request's step time goes on a GPU (host side, cProfile), against
plain requests: H100 run of 2026-12-05 measured ruled rows at 0.05-0.09x plain throughput on the
tiny pair (benchmarks/logits_rules_bench.py), far more than leaving the CUDA graphs should cost.

    python3 benchmarks/probes/ruled_step_profile.py [ARMS] [VARIANTS]   (writes $OUT/ruled_profile_*.txt)

PYTHONPATH=OTHER_TREE profiles another tree's package (this checkout's comes after it on the path;
each file's first line names the package that ran: H100 run 47's "old" profile was this tree's
because the checkout came first).
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: another tree may be profiled

from logits_rules_bench import RULE, STRUCTURED_REGEX, prompts, speculative_config  # noqa: E402

import adaspec  # noqa: E402
from adaspec import LLM, SamplingParams  # noqa: E402
from adaspec.sampling_params import StructuredOutputsParams  # noqa: E402


def main() -> int:
    arms = (sys.argv[1] if len(sys.argv) > 1 else "none,fixed:4").split(",")
    variants = (sys.argv[2] if len(sys.argv) > 2 else "plain,ruled,structured").split(",")
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    base = dict(temperature=0.0, seed=1, max_tokens=64)
    made = {"plain": lambda: SamplingParams(**base, ignore_eos=True),
            "ruled": lambda: SamplingParams(**base, ignore_eos=True, **RULE),
            "structured": lambda: SamplingParams(**base, structured_outputs=StructuredOutputsParams(regex=STRUCTURED_REGEX))}
    for arm in arms:
        llm = LLM("tiny", speculative_config=speculative_config(arm), device=os.environ.get("DEVICE", "cuda"), max_num_seqs=64)
        batch = prompts(64, llm.llm_engine.model_config.vocab_size)
        for v in variants:
            params = made[v]()
            llm.generate(batch[:4], params, use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            plain_s = time.perf_counter() - t0
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(batch, params, use_tqdm=False)
            prof.disable()
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(22)
            st.sort_stats("cumulative").print_stats(30)
            text = (f"package {adaspec.__file__}\n{arm} {v}: {plain_s * 1000:.0f} ms unprofiled for 64 x 64 tokens\n"
                    + s.getvalue())
            (out / f"ruled_profile_{arm.replace(':', '')}_{v}.txt").write_text(text)
            print(text[:400].splitlines()[1])
            top = [ln for ln in s.getvalue().splitlines() if ln.strip()][6:20]
            print("\n".join(x[:160] for x in top))
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
