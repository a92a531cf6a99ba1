"""The engine thread hands one step's chunks to the event loop with ONE wake-up per step (a
call_soon_threadsafe per request per step cost about a fifth of the engine thread's time at 256
streaming requests: benchmarks/serve_overhead_bench.py), and every chunk still reaches its own
request's queue, in order."""
from __future__ import annotations

import asyncio

from fake_engine import FakeEngine, expected_text

from adaspec.sampling_params import SamplingParams
from adaspec.serve.engine_thread import EngineThread


def test_one_event_loop_wakeup_per_step_and_every_chunk_delivered():
    et = EngineThread(lambda: FakeEngine(max_num_seqs=8)).start()
    prompts = [[ord(c) for c in f"prompt {i}"] for i in range(6)]

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            wakeups.append(cb)
            return original(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        queues = [await et.add(str(i), p, SamplingParams(max_tokens=12, ignore_eos=True), 0.0, len(p))
                  for i, p in enumerate(prompts)]
        texts = []
        for q in queues:
            ids = []
            while True:
                c = await q.get()
                ids.extend(c.new_token_ids)
                if c.finished:
                    break
            texts.append("".join(chr(t) for t in ids))
        return texts, len(wakeups)

    try:
        texts, wakeups = asyncio.run(main())
        steps = et.call(lambda e: e.stats.num_steps)
    finally:
        et.stop()
    assert texts == [expected_text(p, 12) for p in prompts]
    assert steps >= 12
    # one per request when the engine accepted it, then at most one per step
    assert wakeups <= len(prompts) + steps, f"{wakeups} wake-ups for {steps} steps of {len(prompts)} requests"
