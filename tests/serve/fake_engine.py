"""A fake LLMEngine with the contract of docs/ENGINE_API.md, for fast server-behaviour tests.

Character-level tokenizer (token id = code point, 0 = EOS); each request generates a fixed
pattern starting at an offset chosen by its prompt, so outputs are deterministic. Knobs:
``step_delay`` (seconds per step), ``tokens_per_step`` (>1 mimics speculation), ``eos_at``
(emit EOS at that output position), ``fail_on_step`` (raise in that step number).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from adaspec.errors import InvalidRequestError
from adaspec.outputs import CompletionOutput, RequestOutput
from adaspec.sampling_params import RequestOutputKind

PATTERN = "the quick brown fox jumps over the lazy dog. "
EOS = 0


class FakeTokenizer:
    eos_token_ids = {EOS}
    vocab_size = 0x110000
    max_chars_per_token = 1  # one token per character (adaspec.serve.prompt_bound)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]  # no special tokens to add

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:  # /tokenize's return_token_strs
        return [chr(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        extra = "".join(f"[{k}={v}]" for k, v in sorted(template_kwargs.items()))
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + extra + (
            "<assistant>" if add_generation_prompt else "")


def pattern_start(prompt_ids: list[int]) -> int:
    """Where in PATTERN the fake's output for a prompt starts."""
    return sum(prompt_ids) % len(PATTERN)


def expected_text(prompt_ids: list[int], n: int) -> str:
    """What the fake generates for a prompt (before stops)."""
    start = pattern_start(prompt_ids)
    return "".join(PATTERN[(start + i) % len(PATTERN)] for i in range(n))


@dataclass
class FakeStats:
    num_steps: int = 0
    time_in_steps: float = 0.0  # as EngineStats: the wall seconds inside step()
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_verified_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)
    verified_per_pos: list = field(default_factory=list)
    # each verified draft is predicted to survive with 0.8 (and always does: the fake accepts all)
    predicted_accept_per_pos: list = field(default_factory=list)
    budget_hist: dict = field(default_factory=dict)


class _Req:
    def __init__(self, rid, prompt_ids, params, arrival):
        self.rid, self.prompt_ids, self.params, self.arrival = rid, prompt_ids, params, arrival
        self.out: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.blocks = 0
        self.first_token_time = None
        self.finish_reason = None
        self.stop_reason = None
        self.text = ""
        # the pattern's offset and the decoded output so far, kept per request: recomputing them
        # every step made the fake's own host work O(tokens) per request per step, which capped
        # benchmarks/serve_overhead_bench.py at the fake's speed instead of the server's
        self.start = pattern_start(prompt_ids)
        self.decoded = ""
        self.reported = 0  # output tokens already in an output (RequestOutputKind.NEW_TOKENS)


class FakeEngine:
    def __init__(self, max_model_len=256, max_num_seqs=8, num_kv_blocks=256, block_size=16, step_delay=0.0,
                 tokens_per_step=1, eos_at=None, fail_on_step=None, model_name="fake", host_work=0.0):
        self.tokenizer = FakeTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self._total_blocks = num_kv_blocks
        self._free_blocks = num_kv_blocks
        self.step_delay = step_delay
        self.host_work = host_work  # seconds of pure-Python work per step, holding the GIL (a real step's host side)
        self.tokens_per_step = tokens_per_step
        self.eos_at = eos_at
        self.fail_on_step = fail_on_step
        n_pos = max(0, tokens_per_step - 1)
        self.stats = FakeStats(accepted_per_pos=[0] * n_pos, verified_per_pos=[0] * n_pos,
                               predicted_accept_per_pos=[0.0] * n_pos)
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._ids: set[str] = set()
        self.thread_ids: set[int] = set()  # every thread that called in: the server must use one

    def _touch(self):
        import threading

        self.thread_ids.add(threading.get_ident())

    # --- contract ---
    def add_request(self, request_id, prompt, params, arrival_time=None):
        self._touch()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id in self._ids:
            raise InvalidRequestError(f"duplicate request id {request_id}", param="request_id")
        if not ids:
            raise InvalidRequestError("empty prompt", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt of {len(ids)} tokens exceeds max_model_len", param="prompt")
        self._ids.add(request_id)
        self.waiting.append(_Req(request_id, ids, params, arrival_time or time.monotonic()))

    def abort_request(self, request_id):
        self._touch()
        for lst in (self.waiting, self.running):
            for r in lst:
                if r.rid == request_id:
                    lst.remove(r)
                    self._free_blocks += r.blocks
                    self._ids.discard(request_id)
                    return

    def has_unfinished_requests(self):
        self._touch()
        return bool(self.waiting or self.running)

    def num_running(self):
        return len(self.running)

    def num_waiting(self):
        return len(self.waiting)

    def kv_blocks_total(self):
        return self._total_blocks

    def kv_blocks_free(self):
        return self._free_blocks

    def _need(self, r: _Req) -> int:
        limit = r.params.max_tokens or self.max_model_len
        total = min(self.max_model_len, len(r.prompt_ids) + limit)
        return -(-total // self.block_size)

    def step(self):
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats.time_in_steps += time.perf_counter() - t0

    def _step(self):
        self._touch()
        self.stats.num_steps += 1
        if self.fail_on_step is not None and self.stats.num_steps >= self.fail_on_step:
            raise RuntimeError("fake engine failure")
        if self.host_work:
            until = time.perf_counter() + self.host_work
            while time.perf_counter() < until:
                pass
        if self.step_delay:
            time.sleep(self.step_delay)
        while self.waiting and len(self.running) < self.max_num_seqs and self._need(self.waiting[0]) <= self._free_blocks:
            r = self.waiting.pop(0)
            r.blocks = self._need(r)
            self._free_blocks -= r.blocks
            self.running.append(r)
        outputs = []
        k = self.tokens_per_step
        if k > 1:
            self.stats.budget_hist[k - 1] = self.stats.budget_hist.get(k - 1, 0) + 1
        for r in list(self.running):
            prefill = not r.out
            if prefill:
                self.stats.num_prompt_tokens += len(r.prompt_ids)
            n_new = 1 if prefill else k
            if not prefill and k > 1:
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += k - 1
                self.stats.num_accepted_tokens += k - 1
                self.stats.num_verified_tokens += k
                for i in range(k - 1):
                    self.stats.accepted_per_pos[i] += 1
                    self.stats.verified_per_pos[i] += 1
                    self.stats.predicted_accept_per_pos[i] += 0.8
            before = len(r.out)
            for _ in range(n_new):
                self._emit(r)
                if r.finish_reason:
                    break
            self.stats.num_generated_tokens += len(r.out) - before
            if r.first_token_time is None:
                r.first_token_time = time.monotonic()
            outputs.append(self._output(r))
            if r.finish_reason:
                self.running.remove(r)
                self._free_blocks += r.blocks
                self._ids.discard(r.rid)
                self.stats.num_requests_finished += 1
        return outputs

    def _emit(self, r: _Req) -> None:
        p = r.params
        pos = len(r.out)
        tid = EOS if (self.eos_at is not None and pos == self.eos_at) else ord(PATTERN[(r.start + pos) % len(PATTERN)])
        r.out.append(tid)
        if tid != EOS:
            r.decoded += chr(tid)
        if p.logprobs is not None:
            d = {tid: -0.25}
            for j in range(p.logprobs):
                d.setdefault(ord("A") + j, -2.0 - j)
            r.logprobs.append(d)
        if (tid in self.tokenizer.eos_token_ids and not p.ignore_eos) or tid in p.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", (None if tid == EOS else tid)
        elif p.max_tokens is not None and len(r.out) >= p.max_tokens:
            r.finish_reason = "length"
        elif len(r.prompt_ids) + len(r.out) >= self.max_model_len:
            r.finish_reason = "length"
        text = r.decoded  # == self.tokenizer.decode(r.out)
        for s in p.stop:
            i = text.find(s)
            if i >= 0:
                r.finish_reason, r.stop_reason = "stop", s
                r.text = text[: i + len(s)] if p.include_stop_str_in_output else text[:i]
                return
        if r.finish_reason:
            r.text = text
            return
        hold = 0  # hold back the longest suffix that could still become a stop string
        for s in p.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        r.text = text[: len(text) - hold]

    def _output(self, r: _Req) -> RequestOutput:
        out, lps = r.out, r.logprobs
        if r.params.output_kind is RequestOutputKind.NEW_TOKENS:  # as the real engine: the new ones only
            out, lps = out[r.reported:], lps[r.reported:]
            r.reported = len(r.out)
        comp = CompletionOutput(0, r.text, list(out), r.finish_reason, r.stop_reason,
                                list(lps) if r.params.logprobs is not None else None)
        return RequestOutput(r.rid, None, list(r.prompt_ids), [comp], r.finish_reason is not None,
                             arrival_time=r.arrival, first_token_time=r.first_token_time,
                             num_new_tokens=1)
