"""Async scheduling of plain decode steps (vLLM's `--async-scheduling`): the host schedules and
launches step t while the GPU still runs step t-1, and reads step t-1's tokens back only after.

Without it the host's work per step (scheduling, building the inputs, stop checks,
detokenization, the outputs) and the GPU's forward run one after the other: on the H200 the
host was 12-20% of a decode step of the Qwen3-4B shape, and up to 33% at batch 256 of the 0.6B
shape (BENCHMARKS.md). With it a step costs max(host, GPU) instead of their sum.

How: a request that samples in step t-1 gets a placeholder token (PENDING) at the end of its
token_ids at once, so everything that counts tokens (the scheduler, positions, seeds of the
sampling randoms) already sees its next position. Step t's input for that position is taken on
the device from step t-1's sampled tokens (ForwardItem.prev_row), and the placeholder is
replaced by the real token when step t-1 is read back, before its stop checks. A request that
stops in step t-1 (EOS, a stop token or string) has already been scheduled in step t: that row
is computed and thrown away (vLLM pays the same), and counted in EngineStats.num_discarded_rows.
The outputs are those of a synchronous run, token for token (tests/engine/test_async_step.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adaspec.engine.sequence import Sequence

PENDING = -1  # a token sampled on the device and not read back yet (real token ids are >= 0)


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens are still on their way to the host."""

    seqs: list[Sequence]  # the requests that sample in the step, in row order
    indices: list[int]  # where each one's token goes in its token_ids (a PENDING until resolved)
    tokens: torch.Tensor  # [n] int64 on the device: the next step reads its inputs from here
    host: tuple[torch.Tensor, ...]  # tokens (and logprob tensors) copied to the host asynchronously
    ready: torch.cuda.Event | None  # recorded after the copies (None on CPU: they are done)
    want_logprobs: list[int | None]

    @property
    def rows(self) -> dict[int, int]:
        """id(seq) -> its row in `tokens`."""
        return {id(s): i for i, s in enumerate(self.seqs)}

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor, logprob_tensors: tuple[torch.Tensor, ...],
               want_logprobs: list[int | None], placeholders: bool = True) -> "InFlightStep":
        """Append a placeholder to every sampling request (placeholders=False: the caller keeps
        the requests out of the next step instead) and start the copies to the host."""
        indices = []
        for s in seqs:
            indices.append(len(s.token_ids))
            if placeholders:
                s.token_ids.append(PENDING)
        on_cuda = tokens.device.type == "cuda"
        host = tuple(t.to("cpu", non_blocking=on_cuda) for t in (tokens, *logprob_tensors))
        ready = None
        if on_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return cls(seqs, indices, tokens, host, ready, want_logprobs)

    def wait(self) -> tuple[list[int], list[dict] | None]:
        """The step's tokens (and logprob dicts) on the host: the step's one device-to-host wait."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host[0].tolist()
        if len(self.host) == 1:
            return tokens, None
        c_lp, top_ids, top_lp = (t.tolist() for t in self.host[1:])
        return tokens, logprob_dicts(tokens, c_lp, top_ids, top_lp, self.want_logprobs)


def logprob_dicts(tokens: list[int], chosen_lp: list[float], top_ids: list[list[int]], top_lp: list[list[float]],
                  want: list[int | None]) -> list[dict | None]:
    """OpenAI-style logprobs per row: the top-n ({token: logprob}) plus the chosen token."""
    return [None if w is None else {**dict(zip(top_ids[i][:w], top_lp[i][:w])), tokens[i]: chosen_lp[i]}
            for i, w in enumerate(want)]


def strip_pending(seq: Sequence) -> None:
    """Drop the placeholders at the end of a request's tokens (it finished or was aborted while a
    step was in flight: those tokens will never be read)."""
    ids = seq.token_ids
    while ids and ids[-1] == PENDING:
        ids.pop()
