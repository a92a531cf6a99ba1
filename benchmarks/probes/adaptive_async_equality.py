"""GPU probe: which engine configurations of the tiny pair give the no-spec engine's float32
greedy tokens (adaptive speculation with and without async scheduling, graphed and eager).
Prints one line per configuration: requests identical / total, steps, plain steps, graphed steps.

    python3 benchmarks/probes/adaptive_async_equality.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from adaspec import LLM, SamplingParams  # noqa: E402


def prompts(n, vocab=8000):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, vocab, (int(L),), generator=g).tolist() for L in torch.randint(5, 60, (n,), generator=g)]


def main():
    ps = prompts(19)
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * (i % 7), ignore_eos=True) for i in range(19)]
    base = dict(max_num_seqs=24, device="cuda", dtype="float32")
    want = [o.outputs[0].token_ids for o in LLM("tiny", enforce_eager=True, async_scheduling=False, **base).generate(ps, params)]
    spec = {"method": "dspark", "num_speculative_tokens": 5, "enable_adaptive_verification": True}
    configs = {
        "none graphed async": dict(),
        "adaptive graphed async": dict(speculative_config=spec),
        "adaptive graphed sync": dict(speculative_config=spec, async_scheduling=False),
        "adaptive eager async": dict(speculative_config=spec, enforce_eager=True),
        "adaptive eager sync": dict(speculative_config=spec, enforce_eager=True, async_scheduling=False),
        "adaptive graphed async tables": dict(speculative_config={**spec, "adaptive_verification_step_costs": "tables"}),
        "adaptive graphed async split": dict(speculative_config=spec, cudagraph_mode="FULL_DECODE_ONLY", async_scheduling=True),
    }
    for name, kw in configs.items():
        try:
            llm = LLM("tiny", **base, **kw)
            got = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
        except Exception as e:  # report and go on
            print(f"{name:32s} ERROR {type(e).__name__}: {e}")
            continue
        st, eng = llm.llm_engine.stats, llm.llm_engine
        same = sum(a == b for a, b in zip(want, got))
        first = next(((i, a, b) for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        print(f"{name:32s} identical {same}/{len(want)} steps {st.num_steps} plain {st.num_steps_draft_skipped} "
              f"graphed {st.num_graphed_steps} async {eng.async_scheduling} mixed {eng.runner.num_mixed_graph_steps} "
              f"split {eng.runner.num_split_steps} eager {eng.runner.num_eager_steps} first diff {first}")


if __name__ == "__main__":
    main()
