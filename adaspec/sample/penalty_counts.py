"""The penalties' token counts of every penalized request, kept on the device between steps as
rows of two shared tensors, and brought up to date for all requests of a step at once.

Why shared rows: with one [V] tensor per request, each step paid an upload and an index_put per
request (~150 us of host time each on CUDA; 64 penalized requests of the tiny pair ran at 0.09x
the plain rate on an H100, benchmarks/probes/ruled_step_profile.py). Here a step pays one upload
of every request's new tokens and one scatter for them all, and the rows it needs are gathered
in one indexing.

A request's row is held by a `CountsSlot` on its history (an engine Sequence's
logits_rule_state, which the engine drops when the request finishes) and given back when that is
dropped (weakref.finalize), then zeroed when it is handed out again. Rows of histories that cannot
keep state (tests' plain rows) are taken for one call. The pool grows to the most rows held at
once (the penalized requests running) and is not shrunk: at a 152k vocabulary a row is 0.76 MB.
"""
from __future__ import annotations

import threading
import weakref

import torch

from adaspec.h2d import to_device_many


class CountsSlot:
    """One history's row in a PenaltyCounts pool and how much of its output the row counts."""

    def __init__(self, pool: PenaltyCounts, slot: int):
        self.pool, self.slot, self.num_counted = pool, slot, 0
        weakref.finalize(self, pool.release, slot)


class PenaltyCounts:
    """Output token counts [slots, V] float32 and prompt masks [slots, V] bool on one device."""

    def __init__(self, vocab_size: int, device):
        self.V, self.device = int(vocab_size), torch.device(device)
        self.counts = torch.zeros(0, self.V, dtype=torch.float32, device=self.device)
        self.in_prompt = torch.zeros(0, self.V, dtype=torch.bool, device=self.device)
        self._free: list[int] = []
        self._lock = threading.Lock()  # engines of one process (threads) share a device's pool

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    def release(self, slot: int) -> None:
        self._free.append(slot)  # list.append is atomic: finalizers may run on any thread

    def _acquire(self) -> int:
        if not self._free:
            old = self.capacity
            new = max(8, 2 * old)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.V)])
            self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(new - old, self.V)])
            self._free.extend(range(new - 1, old - 1, -1))
        return self._free.pop()

    def update(self, histories: list) -> tuple[torch.Tensor, list[CountsSlot]]:
        """Bring the rows of these histories up to date (objects with .prompt and .output, e.g.
        RuleRows, one per distinct history, whose .history keeps a CountsSlot where it can): one
        upload, one scatter. -> (each history's row, int64 on the device; the rows lent for this
        call, which go back to the pool once the caller drops them: keep them until its gathers
        are queued)."""
        temporary: list[CountsSlot] = []
        with self._lock:
            slots, fresh, recount = [], [], []
            prompt_slots, prompt_tokens, new_slots, new_tokens = [], [], [], []
            for row in histories:
                holder = row.history
                state = getattr(holder, "logits_rule_state", None)
                if not isinstance(state, CountsSlot) or state.pool is not self:
                    state = CountsSlot(self, self._acquire())
                    fresh.append(state.slot)
                    uniq = sorted(set(row.prompt))
                    prompt_slots.extend([state.slot] * len(uniq))
                    prompt_tokens.extend(uniq)
                    if holder is not None and hasattr(holder, "logits_rule_state"):
                        holder.logits_rule_state = state
                    else:
                        temporary.append(state)
                elif len(row.output) < state.num_counted:  # the history shrank (it never does): count afresh
                    recount.append(state.slot)
                    state.num_counted = 0
                new = row.output[state.num_counted:]
                new_slots.extend([state.slot] * len(new))
                new_tokens.extend(new)
                state.num_counted = len(row.output)
                slots.append(state.slot)
            (fresh_t, recount_t, ps, pt, ns, nt, slots_t) = to_device_many(
                [fresh, recount, prompt_slots, prompt_tokens, new_slots, new_tokens, slots], self.device)
            if fresh:
                self.counts[fresh_t] = 0.0
                self.in_prompt[fresh_t] = False
            if recount:
                self.counts[recount_t] = 0.0
            if prompt_slots:
                self.in_prompt[ps, pt] = True
            if new_slots:
                self.counts.index_put_((ns, nt), torch.ones(len(new_slots), device=self.device), accumulate=True)
        return slots_t, temporary

    def gather(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts [n, V] float32, in_prompt [n, V] bool) of rows `at` (device int64): copies the
        caller may change."""
        with self._lock:  # (another engine's update may be growing the tensors)
            return self.counts[at], self.in_prompt[at]

    def rows(self, histories: list, of_row: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """update(histories), then the rows of output rows n, each of history of_row[n]."""
        slots_t, lent = self.update(histories)
        (of_row_t,) = to_device_many([of_row], self.device)
        out = self.gather(slots_t[of_row_t])
        del lent  # back to the pool: whoever takes a row next zeroes it in an operation queued after this gather
        return out


_POOLS: dict[tuple[str, int], PenaltyCounts] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(vocab_size: int, device) -> PenaltyCounts:
    """The process's pool for this vocabulary size and device."""
    key = (str(torch.device(device)), int(vocab_size))
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = PenaltyCounts(vocab_size, device)
        return pool
