"""A step's sampling parameters as tensors, built once and shared by drafting, verification
and plain sampling (instead of one torch.tensor([...]) per use)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from adaspec.h2d import to_device
from adaspec.sample.probs import processed_probs, sample_from_logits

# top_k only matters below the vocabulary size; a larger value means "off" and is clamped so
# that any int the API let through fits the int64 tensor
_TOP_K_CAP = 1 << 31


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32, 0 = greedy
    top_p: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64, 0 = off
    seeds: torch.Tensor  # [N] int64 (sample/random.py)
    greedy: list[bool]  # host copy: decides code paths without a device sync
    any_filter: bool  # some row uses top-k or top-p
    logprobs: list[int | None]  # per row: top logprobs wanted (None: none)

    @classmethod
    def build(cls, params: list, seeds: list[int], device) -> "SamplingBatch":
        """params: SamplingParams per row; seeds: the requests' seeds (sample/random.py)."""
        greedy = [p.greedy for p in params]
        temps = [0.0 if g else float(p.temperature) for g, p in zip(greedy, params)]
        host = torch.tensor(temps, dtype=torch.float32), torch.tensor([float(p.top_p) for p in params]), \
            torch.tensor([min(int(p.top_k), _TOP_K_CAP) for p in params], dtype=torch.int64), \
            torch.tensor(seeds, dtype=torch.int64)
        t, tp, tk, sd = (to_device(x, device) for x in host)
        return cls(t, tp, tk, sd, greedy, any(p.top_p < 1 or p.top_k > 0 for p in params),
                   [p.logprobs for p in params])

    def as_greedy(self) -> "SamplingBatch":
        """The same rows at temperature 0 (greedy drafting), without another host-to-device copy."""
        return SamplingBatch(torch.zeros_like(self.temperature), self.top_p, self.top_k, self.seeds,
                             [True] * len(self.greedy), self.any_filter, self.logprobs)

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    def probs(self, logits: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """processed_probs of logits [N * repeat, V], row n*repeat + j using row n's params."""
        rep = (lambda x: x.repeat_interleave(repeat)) if repeat > 1 else (lambda x: x)
        return processed_probs(logits, rep(self.temperature), rep(self.top_p), rep(self.top_k),
                               any_filter=self.any_filter, any_greedy=any(self.greedy))

    def draw(self, logits: torch.Tensor, uniforms: torch.Tensor, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [N], probs [N, V]) of logits [N, V]: `probs`, then one inverse-CDF draw per row
        with uniforms [N] (sample/probs.py, sample_from_logits; out: where the probs go)."""
        return sample_from_logits(logits, self.temperature, self.top_p, self.top_k, uniforms,
                                  any_filter=self.any_filter, any_greedy=any(self.greedy), out=out)

    def want_logprobs(self) -> bool:
        return any(w is not None for w in self.logprobs)


class SameRequestsCache:
    """The last value built from a step's requests (build(seqs, device)), handed out again while a
    step has the same requests in the same order: in steady decoding the same running requests
    come step after step. For values that depend only on what a request fixes before its first
    step (its parameters, its seed). The cache holds the sequences themselves, compared by
    identity: a finished request cannot be mistaken for a new one that Python placed at its
    address, since the cached one is still alive."""

    def __init__(self, build) -> None:
        self._build = build
        self._seqs: list = []
        self._value = None
        self._device = None
        self._filled = False

    def get(self, seqs: list, device):
        cached = self._seqs
        if (self._filled and device == self._device and len(seqs) == len(cached)
                and all(a is b for a, b in zip(seqs, cached))):
            return self._value
        self._value = self._build(seqs, device)
        self._seqs, self._device, self._filled = list(seqs), device, True
        return self._value


class SamplingBatchCache(SameRequestsCache):
    """The plain step's SamplingBatch: rebuilding it (four host lists, four host-to-device copies)
    was a fifth of the plain step's host sampling time at 256 requests (benchmarks/host_step_bench.py
    --temperature 1)."""

    def __init__(self) -> None:
        super().__init__(lambda seqs, device: SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs],
                                                                  device))
