"""Draft slots verified apart (scheduler.py): when the speculative step's graphs verify the decoding
rows in a forward of their own, their draft slots take nothing from the prefill chunks' budget."""
from adaspec.engine.block_manager import BlockManager
from adaspec.engine.scheduler import Scheduler
from adaspec.engine.sequence import Sequence
from adaspec.sampling_params import SamplingParams
from adaspec.spec_decode.step import graphs_serve

K = 7
BUDGET = 64


def _decoding(sch: Scheduler, i: int, **params) -> Sequence:
    seq = Sequence(f"d{i}", None, list(range(1, 11)), SamplingParams(max_tokens=100, **params))
    sch.add(seq)
    sch.waiting.remove(seq)
    seq.token_ids += [5, 6]  # two outputs: it decodes its last token
    seq.num_computed_tokens = len(seq.token_ids) - 1
    sch.bm.grow(seq, len(seq.token_ids))
    sch.running.append(seq)
    return seq


def _step(max_rows: int, n_decoding: int = 4, **params):
    """(draft slots per decoding row, the waiting prompt's chunk) for one step."""
    sch = Scheduler(BlockManager(256, 4), 16, BUDGET, 400, num_spec_tokens=K, draft_lookahead=K)
    sch.set_verify_apart(max_rows, graphs_serve)
    for i in range(n_decoding):
        _decoding(sch, i, **params)
    sch.add(Sequence("p", None, list(range(1, 201)), SamplingParams(max_tokens=8)))
    out = sch.schedule()
    return [s.spec_slots for s in out[:n_decoding]], out[-1].num_tokens


def test_slots_verified_apart_leave_the_budget_to_the_prefill_chunk():
    slots, chunk = _step(max_rows=16)
    assert slots == [K] * 4
    assert chunk == BUDGET - 4  # each decoding row counts its one token only


def test_without_graphs_every_slot_is_taken_from_the_budget():
    slots, chunk = _step(max_rows=0)
    assert slots == [K] * 4
    assert chunk == BUDGET - 4 * (1 + K)


def test_rows_the_graphs_do_not_serve_count_their_slots():
    # logprobs (and top-k / top-p) run in the eager forward beside the prefill chunk
    slots, chunk = _step(max_rows=16, logprobs=2)
    assert slots == [K] * 4 and chunk == BUDGET - 4 * (1 + K)
    slots, chunk = _step(max_rows=16, top_k=5)
    assert chunk == BUDGET - 4 * (1 + K)


def test_at_most_max_rows_are_verified_apart():
    # the graphs' largest batch: rows past it run eagerly with the prefill chunk
    slots, chunk = _step(max_rows=3, n_decoding=4)
    assert slots == [K] * 4
    assert chunk == BUDGET - 3 - (1 + K)


def test_slots_apart_are_not_capped_by_the_budget():
    # 7 decoding rows of 1 + 7 tokens = 56 of 64: counted in the budget the last rows would get
    # fewer slots and the prompt only 8 tokens; apart every row drafts k and the prompt gets 57
    slots, chunk = _step(max_rows=16, n_decoding=7)
    assert slots == [K] * 7 and chunk == BUDGET - 7
    slots, chunk = _step(max_rows=0, n_decoding=7)
    assert chunk == BUDGET - 7 * (1 + K)


def test_releasing_the_graphs_takes_the_slots_back_into_the_budget():
    sch = Scheduler(BlockManager(256, 4), 16, BUDGET, 400, num_spec_tokens=K, draft_lookahead=K)
    sch.set_verify_apart(16, graphs_serve)
    seqs = [_decoding(sch, i) for i in range(2)]
    assert all(s.verify_apart for s in seqs)
    sch.set_verify_apart(0, graphs_serve)  # spec.use_graphs(None): the engine runs eagerly now
    assert not any(s.verify_apart for s in seqs)
    sch.add(Sequence("p", None, list(range(1, 201)), SamplingParams(max_tokens=8)))
    assert sch.schedule()[-1].num_tokens == BUDGET - 2 * (1 + K)
