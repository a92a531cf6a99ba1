"""Request outputs in vLLM's offline-API shape."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative text, minus any held-back partial stop-string match
    token_ids: list[int]  # cumulative generated token ids
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # one dict per generated token: {token_id: logprob}, chosen token included
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # engine-side timestamps (time.monotonic()) for metrics
    arrival_time: float = 0.0
    first_token_time: float | None = None
    num_new_tokens: int = 0  # tokens this step added (several under speculation)
