"""Draft slots verified apart (scheduler.py): when the speculative step's graphs verify the decoding
rows in a forward of their own, their draft slots take nothing from the prefill chunks' budget."""
import pytest
import torch

from adaspec import LLM
from adaspec.engine.block_manager import BlockManager
from adaspec.engine.scheduler import Scheduler
from adaspec.engine.sequence import Sequence
from adaspec.sample.logits_rules import LogitsRule
from adaspec.sampling_params import SamplingParams
from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir, use_eager_spec_graphs

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
    sch.set_verify_apart(max_rows)
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


def test_rows_with_logprobs_or_filters_are_verified_apart_too():
    # the graphs serve them (their acceptance is redone after the replay: graphed_extras.py)
    for extra in (dict(logprobs=2), dict(top_k=5), dict(top_p=0.5)):
        slots, chunk = _step(max_rows=16, **extra)
        assert slots == [K] * 4 and chunk == BUDGET - 4


def test_rows_with_logits_rules_are_verified_apart_too():
    # the graphs serve them, their verification redone after the replay (spec_decode/graphed_extras.py)
    sch = Scheduler(BlockManager(256, 4), 16, BUDGET, 400, num_spec_tokens=K, draft_lookahead=K)
    sch.set_verify_apart(16)
    seqs = [_decoding(sch, i, presence_penalty=0.5 if i % 2 else 0.0) for i in range(4)]
    for s in seqs:
        s.logits_rule = LogitsRule.of(s.params, set(), 100)
    sch.add(Sequence("p", None, list(range(1, 201)), SamplingParams(max_tokens=8)))
    out = sch.schedule()
    assert [s.spec_slots for s in out[:4]] == [K] * 4
    assert out[-1].num_tokens == BUDGET - 4


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
    sch.set_verify_apart(16)
    for i in range(2):
        _decoding(sch, i)
    sch.set_verify_apart(0)  # spec.use_graphs(None): the engine runs eagerly now
    sch.add(Sequence("p", None, list(range(1, 201)), SamplingParams(max_tokens=8)))
    assert sch.schedule()[-1].num_tokens == BUDGET - 2 * (1 + K)


def test_reserve_all_spec_slots_keeps_the_old_budget():
    # the pre-v0.28 budget: max_num_seqs * k up front, and every decoding row's slots on top
    chunks = []
    for max_rows in (0, 16):
        sch = Scheduler(BlockManager(256, 4), 4, BUDGET, 400, num_spec_tokens=K, draft_lookahead=K,
                        reserve_all_spec_slots=True)
        sch.set_verify_apart(max_rows)
        for i in range(2):
            _decoding(sch, i)
        sch.add(Sequence("p", None, list(range(1, 201)), SamplingParams(max_tokens=8)))
        chunks.append(sch.schedule()[-1].num_tokens)
    assert chunks == [BUDGET - 4 * K - 2 * (1 + K)] * 2


def test_a_running_prefill_chunk_counts_its_tokens():
    # a request the graphs would serve, still in prefill: its chunk is eager work, all of it counted
    sch = Scheduler(BlockManager(256, 4), 16, BUDGET, 400, num_spec_tokens=K, draft_lookahead=K)
    sch.set_verify_apart(16)
    for i in range(2):
        _decoding(sch, i)
    mid = Sequence("m", None, list(range(1, 41)), SamplingParams(max_tokens=8))
    sch.add(mid)
    sch.waiting.remove(mid)
    mid.num_computed_tokens = 10  # 30 prompt tokens left
    sch.bm.grow(mid, 10)
    sch.running.append(mid)
    sch.add(Sequence("p", None, list(range(1, 201)), SamplingParams(max_tokens=8)))
    out = sch.schedule()
    assert [s.num_tokens for s in out] == [1, 1, 30, BUDGET - 2 - 30]
    assert [s.spec_slots for s in out] == [K, K, 0, 0]


def test_slots_from_the_budget_shrink_to_what_it_leaves():
    # without graphs: two rows take 1 + k each, the third finds k tokens left (its own and k - 1 slots)
    sch = Scheduler(BlockManager(256, 4), 16, 2 * (1 + K) + K, 400, num_spec_tokens=K, draft_lookahead=K)
    for i in range(3):
        _decoding(sch, i)
    assert [s.spec_slots for s in sch.schedule()] == [K, K, K - 1]


def test_a_drafting_row_holds_blocks_up_to_the_draft_lookahead():
    # the draft block writes K/V past the verified slots, up to the lookahead
    sch = Scheduler(BlockManager(256, 4), 16, BUDGET, 400, num_spec_tokens=K, draft_lookahead=4 * K)
    seq = _decoding(sch, 0)
    (s,) = sch.schedule()
    assert s.spec_slots == K and len(seq.block_table) * 4 >= seq.num_computed_tokens + 4 * K


def test_a_row_in_flight_drafts_k_apart_whatever_the_budget():
    # pipelined steps: a row whose step is still in flight counts one certain token
    for max_rows, slots in ((16, K), (0, 3)):
        sch = Scheduler(BlockManager(256, 4), 16, 4, 400, num_spec_tokens=K, draft_lookahead=K)
        sch.set_verify_apart(max_rows)
        seq = _decoding(sch, 0)
        seq.in_flight_max = 1 + K
        (s,) = sch.schedule(pipelined=True)
        assert (s.num_tokens, s.spec_slots) == (1, slots)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("apart")
    target = make_micro_model_dir(root / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    return str(target), str(make_bigram_drafter_dir(root / "drafter", target, block_size=K))


@pytest.mark.parametrize("pipelined, served_only", [(False, True), (True, True), (False, False)])
def test_no_eager_forward_exceeds_the_budget(pair, pipelined, served_only):
    """The engine end to end, with graphs for fewer requests than run (batch sizes up to 3 of 6
    slots) and, unless served_only, rows with logprobs or top-k (redone after the graphs' replay):
    every eager forward, which is all the budget bounds, stays within it, and the greedy rows equal
    the plain engine's."""
    budget = 32
    llm = LLM(pair[0], speculative_config={"method": "dspark", "model": pair[1], "num_speculative_tokens": K},
              max_num_seqs=6, max_num_batched_tokens=budget, block_size=8, async_scheduling=pipelined)
    eng = llm.llm_engine
    use_eager_spec_graphs(llm, [1, 2, 3])  # replayed eagerly over the same buffers, apart from runner.execute
    sizes = []
    execute = eng.runner.execute

    def counted(items, *args, **kwargs):
        sizes.append(sum(len(item.token_ids) for item in items))
        return execute(items, *args, **kwargs)

    eng.runner.execute = counted
    g = torch.Generator().manual_seed(0)
    sizes_of_prompts = torch.randint(2, 60, (12,), generator=g).tolist()
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in sizes_of_prompts]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    params = [greedy if served_only or i % 4 not in (1, 2) else
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1) if i % 4 == 1 else
              SamplingParams(temperature=1, top_k=5, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert eng.stats.num_graphed_steps > 10 and max(sizes) <= budget
    plain = LLM(pair[0], max_num_batched_tokens=budget, block_size=8).generate(prompts, greedy)
    for i, (o, p) in enumerate(zip(outs, plain)):
        assert len(o.outputs[0].token_ids) == 30
        if params[i] is greedy:
            assert o.outputs[0].token_ids == p.outputs[0].token_ids
