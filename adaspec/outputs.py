"""Request outputs in vLLM's offline-API shape."""
from __future__ import annotations

from dataclasses import dataclass


class Logprob(float):
    """vLLM's Logprob (`.logprob`, `.rank`, `.decoded_token`) that is also the float it holds, so
    code written for either shape reads it. LLM.generate returns these; the engine's own outputs
    (what the server reads) keep plain floats. rank: 1 for the likeliest token of the vocabulary;
    None for a chosen token outside the requested top-n whose rank was not computed (llm.chosen_rank)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str  # cumulative text, minus any held-back partial stop-string match
    token_ids: list[int]  # cumulative generated token ids
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None: an end of sequence)
    # one dict per generated token: {token_id: logprob}, chosen token included (Logprob values
    # from LLM.generate, floats from the engine)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # vLLM's: the chosen tokens' logprobs summed (LLM.generate)

    def finished(self) -> bool:  # vLLM's: a method
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
    # vLLM's: per prompt token {token_id: logprob} (the first: None), when asked (prompt_logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # ours: each prompt token's rank (LLM.generate's Logprob)


def ranked_prompt_logprobs(prompt_ids: list[int], entries: list, ranks: list) -> list[list[tuple] | None]:
    """The engine's prompt logprobs (engine/prompt_logprobs.py: per prompt token a {token_id:
    logprob} of the prompt's top n plus the prompt token, and that token's exact rank) as, per
    token, None (the first) or [(token_id, logprob, rank)] in rank order: the top n ranked 1..n
    around the prompt token's own rank. Shared by LLM.generate (vLLM's Logprob objects) and the
    server (vLLM's prompt_logprobs JSON)."""
    out: list[list[tuple] | None] = []
    for tok, d, rank in zip(prompt_ids, entries, ranks):
        if d is None:
            out.append(None)
            continue
        others = sorted((t for t in d if t != tok), key=lambda t: -d[t])
        ranked = [(t, d[t], i + 1 if i + 1 < rank else i + 2) for i, t in enumerate(others)]
        ranked.append((tok, d[tok], rank))
        out.append(sorted(ranked, key=lambda r: r[2]))
    return out
