"""A TP=2 engine generating until it is stopped: prints its worker pids, then serves requests
in a loop, or (argument "idle") sleeps after one (tests/distributed/test_tp_lifecycle.py kills a
worker under it)."""
import sys
import time

from adaspec import LLM, SamplingParams


def main() -> None:
    llm = LLM("tiny", device="cpu", tensor_parallel_size=2, num_kv_blocks=64, max_model_len=256, max_num_seqs=2)
    print("workers", *llm.llm_engine.tp.procs.pids(), flush=True)
    # short requests: each "step" line comes soon, and the tests wait for the first one (with 200
    # tokens a generate took ~8 s of CPU on 2 cores); the loop keeps the ranks in collectives
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    if sys.argv[1:] == ["idle"]:  # one generate, then nothing: the death is noticed without a step
        llm.generate([[5, 6, 7]], p)
        print("step", flush=True)
        time.sleep(600)
        return 0
    while True:
        llm.generate([[5, 6, 7], "def f(x):"], p)
        print("step", flush=True)


if __name__ == "__main__":
    sys.exit(main())
