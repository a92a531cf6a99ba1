"""Per-request state inside the engine."""
from __future__ import annotations

import enum
import sys
import time

from adaspec.sample.random import seed_to_int64
from adaspec.sampling_params import SamplingParams

_NO_LIMIT = sys.maxsize  # Sequence.max_len without max_tokens: max_model_len alone limits it


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + generated
        self.params = params
        # the length (prompt + output) at which max_tokens ends the request, worked out once (the
        # prompt and the parameters never change): the engine's per-step checks compare against
        # it and the engine's max_model_len, the smaller of the two (_NO_LIMIT: no max_tokens)
        self.max_len = len(self.prompt_token_ids) + params.max_tokens if params.max_tokens is not None else _NO_LIMIT
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # leading tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_token_time: float | None = None
        # every request has a seed: its randoms are keyed by (seed, position), see sample/random.py;
        # None until the engine draws the seeds of the requests added since its last step, at once
        self.seed: int | None = seed_to_int64(params.seed) if params.seed is not None else None
        # text state (see detokenizer.py)
        self.output_text = ""  # stable text exposed to clients
        self.text_stream = None  # incremental detokenizer (StopChecker), made at the first append
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # engine/prompt_logprobs.py: one entry per prompt token (the first: None), and the prompt
        # token's rank at each (for vLLM's Logprob objects)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_logprob_ranks: list[int | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_logprob_ranks = [None], [None]
        # what its sampling parameters do to the logits (sample/logits_rules.py), set by the engine
        # when it adds the request (the rule's token ids are checked against the model's vocabulary)
        self.logits_rule = None
        self.logits_rule_state = None  # its penalty counts row on the device, kept between steps (sample/penalty_counts.py)
        self.grammar_state = None  # structured outputs: its matcher, kept between steps (structured_outputs.py)
        # StopChecker: whether appends take its fast path (no text until the end); None: not yet decided
        self.appends_without_text: bool | None = None
        self.stop_ids: frozenset[int] | None = None  # the tokens that end it on that path (decided with it)
        self.min_tokens_text_len = 0  # with min_tokens and stop strings: the text of its first min_tokens tokens
        # speculative decoding: drafter context K/V is written for positions < drafter_ctx_len
        self.drafter_ctx_len = 0
        self.num_preemptions = 0
        # pipelined speculative steps (spec_decode/pipelined.py): a graphed step not read back yet may
        # append up to in_flight_max tokens (the next step takes the last one and its position on the
        # device); 0: none (a prefill row's sampled token is a PENDING placeholder instead)
        self.in_flight_max = 0
        self.in_flight_step = 0  # serial of that step (only it clears the two fields)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last (freshly sampled) token is missing from the cache."""
        return self.num_uncomputed == 1 and self.num_output_tokens > 0

    @property
    def finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
