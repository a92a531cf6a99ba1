"""The engine process's batches are pulled (serve/engine_process.py): the child sends a request's
news only when the server has asked for more, merging it over the steps in between; acks go at
once. The child's loop (serve_engine) runs here in a thread over a real pipe, with the fake
engine, so every message it sends can be checked in order; the merge is a pure function."""
from __future__ import annotations

import multiprocessing
import operator
import threading

import pytest
from fake_engine import FakeEngine, FakeTokenizer, expected_text

from adaspec.sampling_params import SamplingParams
from adaspec.serve.engine_process import merged_record, serve_engine

UNFINISHED = operator.methodcaller("has_unfinished_requests")  # picklable, as a call over the pipe must be


# -------------------------------------------------------------------- the merge
def _rec(ids, n, suffix="", whole=None, finish=None, stop_reason=None, ftt=None, lps=None, plps=None):
    return ("r", list(ids), lps, n, suffix, whole, finish, stop_reason, ftt, plps)


def test_merged_record_keeps_every_token_the_last_counts_and_the_first_token_time():
    a = _rec([1, 2], 2, suffix="ab", ftt=5.0)
    b = _rec([3], 3, suffix="c", finish="length", stop_reason=None, ftt=5.0)
    assert merged_record(a, b) == ("r", [1, 2, 3], None, 3, "abc", None, "length", None, 5.0, None)
    # the prompt logprobs come with the first tokens, and a merge keeps them
    assert merged_record(_rec([1], 1, plps=[None, {4: -1.0}]), _rec([2], 2))[9] == [None, {4: -1.0}]


def test_merged_record_takes_a_replaced_text_and_what_grew_on_it():
    # the text was rewritten (a held-back stop-string prefix released differently): the whole text wins
    assert merged_record(_rec([1], 1, suffix="a"), _rec([2], 2, whole="xy"))[4:6] == ("", "xy")
    assert merged_record(_rec([1], 1, whole="xy"), _rec([2], 2, suffix="z"))[4:6] == ("", "xyz")


def test_merged_record_concatenates_logprobs_token_by_token():
    a = _rec([1], 1, lps=[{1: -0.1}])
    b = _rec([2, 3], 3, lps=[{2: -0.2}, {3: -0.3}])
    assert merged_record(a, b)[2] == [{1: -0.1}, {2: -0.2}, {3: -0.3}]
    assert merged_record(_rec([1], 1), _rec([2], 2))[2] is None


def test_merged_record_keeps_the_first_known_first_token_time():
    assert merged_record(_rec([], 0), _rec([1], 1, ftt=7.0))[8] == 7.0
    assert merged_record(_rec([1], 1, ftt=3.0), _rec([2], 2, ftt=9.0))[8] == 3.0


# -------------------------------------------------------------------- the child's loop
class _Child:
    def __init__(self, **engine_kw):
        self.conn, child = multiprocessing.Pipe(duplex=True)
        self.engine = FakeEngine(**engine_kw)
        self.thread = threading.Thread(target=serve_engine, args=(self.engine, child), daemon=True)
        self.thread.start()
        self._calls = 0

    def recv(self):
        assert self.conn.poll(30), "the engine loop sent nothing"
        return self.conn.recv()

    def call(self, fn):
        """fn(engine) between steps; nothing but the call's reply may arrive meanwhile."""
        self._calls += 1
        self.conn.send(("call", self._calls, fn))
        msg = self.recv()
        assert msg[0] == "call", f"the engine sent {msg[0]!r} while the server had not asked for more"
        assert msg[2], msg[3]
        return msg[3]

    def wait_finished(self):
        while self.call(UNFINISHED):
            pass

    def stop(self):
        self.conn.send(("stop",))
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def child():
    c = _Child(max_num_seqs=4, max_model_len=64)
    yield c
    if c.thread.is_alive():
        c.stop()


def test_news_waits_for_more_and_comes_merged(child):
    prompt = FakeTokenizer().encode("hi")
    child.conn.send(("add", "r1", prompt, SamplingParams(max_tokens=6), 0.0))
    kind, acks, records, _ = child.recv()  # the ack goes at once, with the first step's news
    assert kind == "batch" and acks == [("r1", None)]
    assert [(r[0], r[1], r[3]) for r in records] == [("r1", [ord(expected_text(prompt, 1))], 1)]
    child.wait_finished()  # five more steps ran; none of their news was sent (call() checks)
    child.conn.send(("more",))
    kind, acks, records, snapshot = child.recv()
    assert kind == "batch" and acks == []
    (rid, ids, lps, n, suffix, whole, finish, _, ftt, _), = records
    text = expected_text(prompt, 6)
    assert (rid, ids, n, finish) == ("r1", [ord(c) for c in text[1:]], 6, "length")
    assert (suffix, whole, lps) == (text[1:], None, None) and ftt is not None
    assert snapshot.running == 0 and snapshot.stats.num_generated_tokens == 6


def test_each_more_lets_one_batch_out(child):
    prompt = FakeTokenizer().encode("ok")
    child.conn.send(("add", "r1", prompt, SamplingParams(max_tokens=40), 0.0))
    got = list(child.recv()[2][0][1])
    while True:
        child.conn.send(("more",))
        kind, acks, records, _ = child.recv()
        assert kind == "batch" and acks == [] and len(records) == 1
        got += records[0][1]
        if records[0][6] is not None:
            break
    assert got == [ord(c) for c in expected_text(prompt, 40)]
    assert not child.conn.poll(0.05)  # nothing left over once the server has had everything


def test_an_add_is_acknowledged_at_once_even_while_news_waits(child):
    child.conn.send(("add", "r1", FakeTokenizer().encode("a"), SamplingParams(max_tokens=30), 0.0))
    assert child.recv()[1] == [("r1", None)]
    child.conn.send(("add", "r2", FakeTokenizer().encode("b"), SamplingParams(max_tokens=3), 0.0))
    msg = child.recv()
    while msg[0] != "batch":
        msg = child.recv()
    assert msg[1] == [("r2", None)]  # not held back for "more": the request's first token waits on it
    assert {r[0] for r in msg[2]} <= {"r1", "r2"}


def test_an_aborted_request_sends_nothing_more_but_the_counts():
    child = _Child(max_num_seqs=4, max_model_len=1 << 20, num_kv_blocks=1 << 16)
    try:  # long enough to be running still when the abort comes (a call is answered between steps)
        child.conn.send(("add", "r1", FakeTokenizer().encode("a"), SamplingParams(max_tokens=1 << 19), 0.0))
        assert child.recv()[1] == [("r1", None)]
        assert child.call(UNFINISHED) is True  # a step or more of news pending
        child.conn.send(("abort", "r1"))
        child.wait_finished()
        child.conn.send(("more",))
        # no news of r1, but the engine's counts moved since the last batch: the server's queue
        # check and gauges need them (else a full queue stayed full), so one batch of them comes
        kind, acks, records, snapshot = child.recv()
        assert (kind, acks, records, snapshot.running, snapshot.waiting) == ("batch", [], [], 0, 0)
        child.conn.send(("more",))
        # a call is answered while its loop turn runs, before that turn's batch would go out: the
        # second reply comes after anything the first one's turn sent
        assert child.call(UNFINISHED) is False and child.call(UNFINISHED) is False
    finally:
        child.stop()


class _SteppedEngine(FakeEngine):
    """Runs a step only when the test releases one: what arrives during a step is then in order."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.go = threading.Semaphore(0)

    def step(self):
        assert self.go.acquire(timeout=30), "the test released no step"
        return super().step()


def test_a_more_that_came_during_a_step_lets_that_step_out():
    """The server's "more" usually arrives while the next step runs; the loop must look for it
    after the step, or every batch would wait one step more and carry two steps' news."""
    conn, child_conn = multiprocessing.Pipe(duplex=True)
    engine = _SteppedEngine(max_num_seqs=4, max_model_len=64)
    t = threading.Thread(target=serve_engine, args=(engine, child_conn), daemon=True)
    t.start()
    try:
        prompt = FakeTokenizer().encode("go")
        conn.send(("add", "r1", prompt, SamplingParams(max_tokens=5), 0.0))
        tokens = [ord(c) for c in expected_text(prompt, 5)]
        for i in range(4):
            engine.go.release()  # step i + 1 runs; "more" (after the first batch) came before it ended
            assert conn.poll(30), f"step {i + 1}'s news did not go out after it"
            kind, acks, records, _ = conn.recv()
            assert kind == "batch" and acks == ([("r1", None)] if i == 0 else [])
            assert [r[1] for r in records] == [[tokens[i]]]
            conn.send(("more",))
    finally:
        engine.go.release(10)
        conn.send(("stop",))
        t.join(30)
