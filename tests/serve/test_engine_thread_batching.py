"""The engine thread hands one step's chunks to the event loop with ONE wake-up per step (a
call_soon_threadsafe per request per step was, with prometheus-client's per-chunk labels(), what
capped a 256-request stream: benchmarks/serve_overhead_bench.py); every chunk still reaches its
own request's queue, in order; and what a step collected is delivered even if a later output of
the step raises (the engine then dies, and every client must hear of it)."""
from __future__ import annotations

import asyncio

from adaspec.outputs import CompletionOutput, RequestOutput
from adaspec.serve.engine_thread import Chunk, EngineThread, _Route


def _out(rid: str, ids: list[int], finished: bool = False) -> RequestOutput:
    """A step's output as the engine thread asks for them (RequestOutputKind.NEW_TOKENS): the
    step's new token ids only."""
    comp = CompletionOutput(0, "".join(chr(97 + t) for t in ids), list(ids), "length" if finished else None)
    return RequestOutput(rid, None, [1], [comp], finished, num_new_tokens=len(ids))


class _Metrics:
    def __init__(self, fail_on_finish: bool = False):
        self.fail_on_finish = fail_on_finish

    def on_chunk(self, *a):
        pass

    def on_finish(self, *a):
        if self.fail_on_finish:
            raise RuntimeError("metrics failed")


def _publish_steps(steps, metrics=None):
    """Publish `steps` (lists of outputs) for requests r0..r2 on a running loop. -> (wake-ups per
    publish, each request's chunks)."""
    et = EngineThread(lambda: None)  # never started: _publish is driven by hand
    et.metrics = metrics

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe

        def counting(cb, *args, **kw):
            wakeups.append(cb)
            return original(cb, *args, **kw)

        loop.call_soon_threadsafe = counting
        queues = {}
        for rid in ("r0", "r1", "r2"):
            queues[rid] = asyncio.Queue()
            et._routes[rid] = _Route(loop, queues[rid], 0.0, 1)
        per_publish = []
        for outs in steps:
            n = len(wakeups)
            try:
                et._publish(outs)
            except RuntimeError:
                pass
            per_publish.append(len(wakeups) - n)
        await asyncio.sleep(0)  # the delivery callbacks run
        got = {rid: [] for rid in queues}
        for rid, q in queues.items():
            while not q.empty():
                got[rid].append(q.get_nowait())
        return per_publish, got

    return asyncio.run(main())


def test_one_wakeup_per_step_and_every_chunk_in_order():
    steps = [[_out("r0", [0]), _out("r1", [1]), _out("r2", [2])],
             [_out("r0", [3]), _out("r1", [4]), _out("r2", [5], finished=True)]]
    per_publish, got = _publish_steps(steps)
    assert per_publish == [1, 1]
    assert [c.new_token_ids for c in got["r0"]] == [[0], [3]]
    assert [c.new_token_ids for c in got["r1"]] == [[1], [4]]
    assert [(c.new_token_ids, c.finish_reason) for c in got["r2"]] == [([2], None), ([5], "length")]
    assert all(isinstance(c, Chunk) for cs in got.values() for c in cs)
    assert [c.num_tokens for c in got["r2"]] == [1, 2]  # counted over the steps


def test_chunks_collected_before_a_failure_are_still_delivered():
    steps = [[_out("r0", [0], finished=True), _out("r1", [1])]]
    per_publish, got = _publish_steps(steps, _Metrics(fail_on_finish=True))
    assert per_publish == [1]
    assert [(c.new_token_ids, c.finish_reason) for c in got["r0"]] == [([0], "length")]


def test_routes_of_unknown_requests_are_skipped():
    per_publish, got = _publish_steps([[_out("gone", [7]), _out("r1", [1])]])
    assert per_publish == [1] and [c.new_token_ids for c in got["r1"]] == [[1]] and not got["r0"]
