"""Sampling of a plain decode step inside CUDA graphs: one small graph per decode graph's request
count B, replayed right after the forward's graph, reading its logits.

Why: the speculative steps sample inside their graphs, while a plain step sampled eagerly after
its graph: temperature scaling, softmax, the keyed uniforms and the inverse CDF are ~10-15 kernel
launches plus a host-to-device copy of the positions, which on the H200 made the no-spec arm at
T = 1 host-bound at one request (1.65-2.11 ms a step against 1.56 ms greedy) and cost it 1.75-2.14
ms of host time a step at 256 (BENCHMARKS.md, run 34). Part of every T = 1 speed-up measured over
no-spec was that handicap, not speculation.

What the graphs compute is the eager sampler's definition, op for op (LLMEngine._sample_on_device:
processed_probs without filters, keyed uniforms of the SAMPLE stream at the position after the
query token, sample_categorical), with greedy rows taken as the argmax (the eager sampler's one-hot
row gives the same index). So a seeded request gets the same tokens either way. Rows with top-k /
top-p are not covered (filtering sorts a [B, vocab] block that every step would pay): a step with
such a row samples eagerly, as before. Logprobs are computed from the same logits after the
replay, as before.

Static inputs: the rows' temperatures and seeds, copied on the device only when the step's
SamplingBatch changes (the engine reuses it while the same requests sample in the same order:
sample/batch.py, SamplingBatchCache); the positions are the forward graph's own buffer.
"""
from __future__ import annotations

import torch

from adaspec.engine.cuda_graphs import GraphedForward, _Graph, release_graphs
from adaspec.engine.graph_capture import record_graph
from adaspec.sample.batch import SamplingBatch
from adaspec.sample.probs import sample_tokens
from adaspec.sample.random import SAMPLE, keyed_uniforms


def sample_decode_rows(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """The next token of each row of logits [N, V] (no filters): greedy rows (temperature 0) the
    argmax, the others drawn from softmax(logits / T) with the SAMPLE stream's uniform at the
    row's next position (its query token's position + 1)."""
    return sample_tokens(logits, temperature, keyed_uniforms(seeds, positions + 1, SAMPLE))


class GraphedDecodeSampler:
    """The sampling graphs of a GraphedForward's one-token decode graphs, and their static inputs."""

    def __init__(self, forward: GraphedForward):
        self.forward = forward
        self.batch_sizes = [b for (b, q) in forward.graphs if q == 1]
        max_b = max(self.batch_sizes, default=0)
        dev = forward.device
        self.temperature = torch.zeros(max_b, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(max_b, dtype=torch.int64, device=dev)
        self.graphs: dict[int, _Graph] = {}
        self._staged: SamplingBatch | None = None  # the batch whose rows the static inputs hold
        self.num_replays = 0

    def _sample(self, b: int, logits: torch.Tensor) -> torch.Tensor:
        return sample_decode_rows(logits[:b], self.temperature[:b], self.seeds[:b], self.forward.positions[:b])

    @torch.inference_mode()
    def capture(self, eager: bool = False) -> None:
        """One graph per decode graph, reading that graph's static logits (in the forward's capture
        pool: replays are sequential, and each graph's output stays its own). eager=True: replays
        sample the logits they are given, eagerly (CPU tests)."""
        for b in self.batch_sizes:
            if eager:
                self.graphs[b] = _Graph(None, None, None)
                continue
            logits = self.forward.graphs[(b, 1)].outputs[0]
            self._sample(b, logits)  # warm-up: the keyed uniforms' kernel compiles outside the capture
            torch.cuda.synchronize(self.forward.device)
            g, tokens = record_graph(lambda b=b, logits=logits: self._sample(b, logits), pool=self.forward.pool)
            self.graphs[b] = _Graph(g, tokens)

    def sample(self, key: tuple[int, int] | None, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
        """The tokens [n] of a step that replayed the decode graph `key` (every row a one-token
        decode that samples, in order; logits its [n, V] output), or None where the graphs do not
        cover it (another graph or none, rows with top-k / top-p): the caller samples eagerly."""
        if key is None or key[1] != 1 or key[0] not in self.graphs or batch.any_filter:
            return None
        b, n = key[0], logits.shape[0]
        g = self.graphs[b]
        if g.graph is not None and logits.data_ptr() != self.forward.graphs[(b, 1)].outputs[0].data_ptr():
            return None  # not the graph's own output (never expected): the eager sampler is always right
        if batch is not self._staged:
            self.temperature[:n].copy_(batch.temperature, non_blocking=True)
            self.seeds[:n].copy_(batch.seeds, non_blocking=True)
            self._staged = batch
        self.num_replays += 1
        if g.graph is None:
            return self._sample(n, logits)
        g.graph.replay()
        # a copy: the static output is overwritten by the next replay, while async scheduling's
        # next step (and the read back) may still read these tokens
        return g.outputs[:n].clone()

    def release(self) -> int:
        self._staged = None
        return release_graphs(self.graphs)

