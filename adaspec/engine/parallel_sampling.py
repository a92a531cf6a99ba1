"""Parallel sampling (``SamplingParams.n > 1``), as vLLM's: a request for n samples of one prompt
runs as n child requests of one sample each, and their outputs come back under the parent's id,
each completion with its ``index``.

Why children and not one request with n rows: every part of the step (the scheduler, the
speculative policy's per-request confidences, the keyed random numbers, stop checks) already
works per request, so n samples need nothing new there; the price is the prompt's prefill, paid
n times (this engine has no prefix cache to share it).

Seeds follow vLLM: a seeded parent gives child j the seed ``seed + j`` (wrapped into the 64-bit
range), so child j's text is that of a request of one sample with that seed; an unseeded parent's
children each get a random seed. Output kinds: FINAL_ONLY gathers the n completions into one
output when the last child finishes; CUMULATIVE and NEW_TOKENS pass each child's update on at once
as an output holding that child's completion alone, ``finished`` only on the update that ends the
last child (vLLM's streaming shape).
"""
from __future__ import annotations

import dataclasses

from adaspec.outputs import RequestOutput
from adaspec.sampling_params import SEED_MAX, SEED_MIN, RequestOutputKind, SamplingParams

_SEED_SPAN = SEED_MAX - SEED_MIN + 1


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"  # vLLM's spelling


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s params: one sample, and the seed ``seed + index`` when the parent is
    seeded (the server's fan-out, serve/generation.py, uses this too)."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index - SEED_MIN) % _SEED_SPAN + SEED_MIN
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """One request of n samples: which children are still running, and their outputs gathered."""

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.n = params.n
        self.final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        self.completions: list = [None] * self.n  # FINAL_ONLY: each child's last completion
        self.running = set(range(self.n))
        self.first_token_time: float | None = None

    def child_ids(self) -> list[str]:
        return [child_request_id(self.request_id, i) for i in range(self.n)]

    def take(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """Child ``index``'s output -> the parent's output to report now, or None (FINAL_ONLY
        before the last child ends)."""
        comp = dataclasses.replace(out.outputs[0], index=index)
        if out.finished:
            self.running.discard(index)
        if out.first_token_time is not None and (self.first_token_time is None
                                                 or out.first_token_time < self.first_token_time):
            self.first_token_time = out.first_token_time
        if self.final_only:
            self.completions[index] = comp
            if self.running:
                return None
            comps = self.completions
        else:
            comps = [comp]
        return dataclasses.replace(out, request_id=self.request_id, outputs=comps, finished=not self.running,
                                   first_token_time=self.first_token_time)


class ParallelSampling:
    """The engine's parents, by child id: maps the step's child outputs back to their parents."""

    def __init__(self):
        self.parents: dict[str, ParentRequest] = {}
        self.child_of: dict[str, tuple[ParentRequest, int]] = {}

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for i, cid in enumerate(parent.child_ids()):
            self.child_of[cid] = (parent, i)

    def gather(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The step's outputs with every child's replaced by its parent's (or left out)."""
        if not self.child_of:
            return outputs
        out = []
        for o in outputs:
            hit = self.child_of.get(o.request_id)
            if hit is None:
                out.append(o)
                continue
            parent, index = hit
            if o.finished:
                self.child_of.pop(o.request_id, None)
            merged = parent.take(index, o)
            if not parent.running:
                self.parents.pop(parent.request_id, None)
            if merged is not None:
                out.append(merged)
        return out
