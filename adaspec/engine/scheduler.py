"""Continuous batching: which requests run this step, and how many tokens each.

Policy, in order (FCFS by arrival):
1. running requests: a decoding request needs 1 token (+ draft slots under speculation),
   one still in prefill gets the next chunk that fits the step's token budget;
2. waiting requests are admitted while `max_num_seqs` and the budget allow.
When KV blocks run out, the most recently admitted running request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed (prompt and
generated tokens alike), as nano-vllm and vLLM do.

Speculative token budget: draft slots are reserved only for requests that actually decode
this step (vLLM v0.28's "adaptive speculative token budget"), so prefill keeps large chunks
at low concurrency. With `reserve_all_spec_slots` the old behaviour is kept: max_num_seqs * k
slots are taken out of the budget up front.

Draft slots verified apart (not with `reserve_all_spec_slots`, which keeps the old budget): when
the speculative step runs the decoding rows in CUDA graphs of their own (a forward apart from the
prefill chunks' eager one, sized at capture), their draft slots take nothing from the token
budget, which bounds the eager forward only: each decoding row counts its one token. Taking them
from it shrank every prefill chunk by the slots (at 256 decoding requests and k = 7, 2,048 of
4,096 tokens), so a wave of prompts needed ~1.6x the mixed steps of the plain engine, each costing
about as much as a full one (H200 run 18, the Qwen3-8B shape: 38 mixed steps of 87 ms against
no-spec's 24 of 93 ms at 256 requests).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from adaspec.engine.block_manager import BlockManager
from adaspec.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)  # one per request per step
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # uncomputed tokens to run this step (prefill chunk, or 1 for a decode)
    spec_slots: int = 0  # draft slots reserved (the policy verifies l_r <= spec_slots of them)
    # a row whose previous step is still in flight (Sequence.in_flight_max > 0): tokens it may still
    # emit once that step's tokens are in (at least one is), max_tokens and max_model_len counted;
    # the device caps its draft slots at remaining - 1 - (drafts that step accepted)
    remaining: int = 0

    @property
    def samples(self) -> bool:
        """The step reaches the end of the sequence, so it yields at least one new token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq.token_ids)


class DrainFirst(Exception):
    """A step launched ahead (pipelined) would need a preemption: the engine reads the step in
    flight back first, then schedules again (a request in flight must not lose its blocks)."""


def check_whole_prompts_fit(max_num_batched_tokens: int, max_model_len: int, enable_chunked_prefill: bool,
                            max_num_seqs: int = 0, num_spec_tokens: int = 0, reserve_all_spec_slots: bool = False) -> None:
    """Without chunked prefill a prompt (or a recomputation after preemption) runs in one step, so
    the step's token budget must hold max_model_len tokens (vLLM's rule); with
    reserve_all_spec_slots the budget is what the draft slots leave. Otherwise a longer prompt would
    wait forever and its engine would never finish: a ConfigError that names the numbers."""
    if enable_chunked_prefill:
        return
    reserved = max_num_seqs * num_spec_tokens if reserve_all_spec_slots else 0
    budget = max_num_batched_tokens - reserved
    if budget < max_model_len:
        from adaspec.errors import ConfigError

        spent = (f" less the {reserved} draft slots reserve_all_spec_slots keeps for max_num_seqs={max_num_seqs} x "
                 f"k={num_spec_tokens}") if reserved else ""
        raise ConfigError(
            f"enable_chunked_prefill=False runs each prompt in one step, so max_num_batched_tokens="
            f"{max_num_batched_tokens}{spent} must be at least max_model_len={max_model_len}: raise "
            f"max_num_batched_tokens, lower max_model_len, or enable chunked prefill")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True, num_spec_tokens: int = 0,
                 reserve_all_spec_slots: bool = False, draft_lookahead: int = 0):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_spec_tokens = num_spec_tokens
        self.reserve_all_spec_slots = reserve_all_spec_slots
        # a draft block writes K/V at positions anchor..anchor+lookahead-1: blocks, not budget
        self.draft_lookahead = draft_lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # draft slots verified apart (set_verify_apart): at most this many decoding rows per step
        self.verify_apart_rows = 0

    def set_verify_apart(self, max_rows: int) -> None:
        """The speculative step verifies the draft slots of up to max_rows decoding requests in a
        forward of its own (its CUDA graphs serve every decoding row, whatever its sampling
        parameters): their slots leave the token budget to the prefill chunks. max_rows = 0 (no
        graphs): every slot is taken from the budget."""
        self.verify_apart_rows = max_rows

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _running_need(self, seq: Sequence, drafts: bool, budget: int,
                      apart: bool = False) -> tuple[int, int, int, int] | None:
        """(tokens to run, draft slots, KV positions needed, remaining) for a running request this step, or
        None when it already holds max_tokens or max_model_len tokens (a synchronous engine has
        finished such a request; under async scheduling the last of them may still be in flight).
        One pass over the request's counters: this runs for every request every step, ~30% of the
        host's work in a speculative step at 256 requests when it went through properties.

        Draft slots: only a decoding request drafts, at most num_spec_tokens, never beyond the
        step's token budget unless its slots are verified apart (`apart`), and never more than
        remaining - 1 (a step emits at most l + 1 tokens: drafts past the request's end could never
        be used).

        A request whose speculative step is still in flight (pipelined steps) counts the one token
        that step surely emits, and needs KV positions as if it emitted all it may."""
        # (min and max, as builtins, cost as much as the rest of a row here: conditionals instead)
        in_flight = seq.in_flight_max
        n_tok = len(seq.token_ids) + (in_flight > 0)
        # tokens it may still emit, max_tokens and max_model_len counted
        limit = seq.max_len if seq.max_len < self.max_model_len else self.max_model_len
        remaining = limit - n_tok
        if remaining <= 0:
            return None
        k = self.num_spec_tokens
        if in_flight:
            room = k if apart else budget - 1
            spec = max(0, min(k, remaining - 1, room)) if drafts else 0
            # the last token's position if every draft is accepted, but never past the request's end:
            # the device caps that step's drafts at the tokens left (on the host in_flight is the
            # uncapped count), and the block table must stay within max_model_len + the lookahead
            last = min(seq.num_computed_tokens + in_flight, n_tok + remaining - 1)
            return 1, spec, max(last + 1 + spec, last + self.draft_lookahead if spec else 0), remaining
        computed = seq.num_computed_tokens
        uncomputed = n_tok - computed
        n_out = n_tok - len(seq.prompt_token_ids)
        if uncomputed == 1 and n_out > 0:  # decoding (most rows, most steps): its one token (budget > 0)
            n, spec = 1, 0
            if drafts and k:
                # the slots the budget leaves (all k when verified apart), at most remaining - 1 (>= 0)
                cap = k if apart or budget > k else budget - 1
                spec = cap if remaining > cap else remaining - 1
        else:
            n, spec = min(self._to_compute(uncomputed, n_out), budget), 0
        total = computed + n + spec
        if spec and total < computed + self.draft_lookahead:  # the draft block writes K/V up to the lookahead
            total = computed + self.draft_lookahead
        return n, spec, total, 0

    def _to_compute(self, uncomputed: int, num_output_tokens: int) -> int:
        """Tokens still to (re)compute before the request samples or drafts. Under speculation a
        request recomputed after preemption stops one token short, so that it resumes as a
        decoding request drafting from its last token, exactly as if it had never been preempted
        (a seeded request's text then does not depend on preemption; README, "Seeds")."""
        recomputing = num_output_tokens > 0 and uncomputed != 1  # has output, and is not decoding
        return uncomputed - 1 if self.num_spec_tokens and recomputing else uncomputed

    def _prefill_left(self, seq: Sequence) -> int:
        return self._to_compute(seq.num_uncomputed, seq.num_output_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.drafter_ctx_len = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, total: int, pipelined: bool) -> bool:
        """Blocks for seq's positions up to total, preempting running requests from the back while
        the free ones do not suffice. -> False when seq itself was preempted. Pipelined: DrainFirst
        instead of a preemption."""
        while not self.bm.try_grow(seq, total):
            if pipelined:
                raise DrainFirst()
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def schedule(self, drafts: bool = True, pipelined: bool = False) -> list[ScheduledSeq]:
        """drafts=False: a step the engine runs without drafting (adaptive speculation under async
        scheduling) reserves no draft slots, so its prefill chunks get the whole budget.
        pipelined: a speculative step is in flight; where a request's blocks would have to come
        from a preemption, DrainFirst is raised instead (the blocks grown so far stay, unused)."""
        budget = self.max_num_batched_tokens
        if self.reserve_all_spec_slots and self.num_spec_tokens and drafts:
            budget = max(1, budget - self.max_num_seqs * self.num_spec_tokens)
        out: list[ScheduledSeq] = []
        block_size = self.bm.block_size
        i = 0
        # reserve_all_spec_slots keeps the pre-v0.28 budget whole: nothing is verified apart there
        apart_left = 0 if self.reserve_all_spec_slots else self.verify_apart_rows
        running, running_need = self.running, self._running_need  # (this loop runs for every request every step)
        while i < len(running) and budget > 0:
            seq = running[i]
            apart = apart_left > 0
            need = running_need(seq, drafts, budget, apart)
            if need is None:  # async scheduling: its last token, in flight, ends it
                i += 1
                continue
            n, spec, total, remaining = need
            # most steps a request's blocks already hold its positions
            if total > len(seq.block_table) * block_size and not self._grow(seq, total, pipelined):
                continue  # it preempted itself: it was the last running request
            out.append(ScheduledSeq(seq, n, spec, remaining))
            if apart and n == 1:  # a decoding row: its graphs verify the slots apart
                apart_left -= 1
                budget -= 1
            else:
                budget -= n + spec
            i += 1
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            n = min(self._prefill_left(seq), budget)
            if n < self._prefill_left(seq) and not self.enable_chunked_prefill:
                break
            if not self.bm.can_grow(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.bm.grow(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n, 0))
            budget -= n
        return out
