"""A stream whose chunks queue up while the event loop is busy gets them merged into one
(serve/generation.py, as vLLM's output collector): one event and one socket write per turn."""
import asyncio
from types import SimpleNamespace

from adaspec.serve.engine_thread import Chunk
from adaspec.serve.errors import APIError
from adaspec.serve.generation import _CLIENT_GONE, _ClientGone, _Generation, merged_chunk


def chunk(text, ids, n, finish=None, lps=None):
    return Chunk(text, ids, lps, n, 3, finish)


def generation(items):
    state = SimpleNamespace(inflight=0, engine_thread=SimpleNamespace(abort=lambda rid: None))
    q = asyncio.Queue()
    for item in items:
        q.put_nowait(item)
    return _Generation(state, "r", q, 0, [1, 2, 3])


def drain(items, calls):
    async def go():
        g = generation(items)
        out = []
        for _ in range(calls):
            try:
                out.append(await g.next())
            except (_ClientGone, APIError) as e:
                out.append(type(e).__name__)
        return out
    return asyncio.run(go())


def test_queued_chunks_come_as_one_with_every_token_and_the_last_text():
    got = drain([chunk("a", [1], 1), chunk("ab", [2], 2), chunk("abc", [3, 4], 4)], 1)
    assert got == [chunk("abc", [1, 2, 3, 4], 4)]


def test_a_finished_chunk_ends_the_merge_and_the_stream():
    got = drain([chunk("a", [1], 1), chunk("ab", [2], 2, finish="length")], 1)
    assert got == [chunk("ab", [1, 2], 2, finish="length")] and got[0].finished


def test_an_error_or_a_departure_behind_chunks_comes_after_them():
    err = APIError(500, "The engine failed")
    assert drain([chunk("a", [1], 1), chunk("ab", [2], 2), err], 2) == [chunk("ab", [1, 2], 2), "APIError"]
    assert drain([chunk("a", [1], 1), _CLIENT_GONE, chunk("ab", [2], 2)], 2) == [chunk("a", [1], 1), "_ClientGone"]


def test_logprobs_are_concatenated_token_by_token():
    first, later = chunk("a", [1], 1, lps=[{1: -0.1}]), chunk("ab", [2, 3], 3, lps=[{2: -0.2}, {3: -0.3}])
    assert merged_chunk(first, later).new_logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}]
    assert merged_chunk(chunk("a", [1], 1), chunk("ab", [2], 2)).new_logprobs is None


def test_a_chunk_alone_in_the_queue_comes_as_it_is():
    assert drain([chunk("a", [1], 1)], 1) == [chunk("a", [1], 1)]
