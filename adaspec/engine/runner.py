"""Model runner: packs one step's requests into ONE varlen forward of the target.

Each item contributes its own query tokens (a prefill chunk, a 1-token decode, or a last
token plus drafts) at its own positions. Attention metadata is built once per step and
shared by every layer. Logits are computed only for the rows the caller needs (the last
row of a sampling request, or every verify row under speculation): the LM head is the
largest matmul for small batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaspec.h2d import to_device
from adaspec.models.attention import build_attention_metadata


@dataclass
class ForwardItem:
    token_ids: list[int]  # query tokens of this request
    start_pos: int  # sequence position of token_ids[0]
    block_table: list[int]
    num_logits: int  # trailing query rows that need logits (0: none)


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [sum num_logits, V] float32, items in order
    hidden: torch.Tensor  # [T, d] final-normed hidden of every query token
    captured: dict[int, torch.Tensor]  # layer id -> [T, d]
    query_start: np.ndarray  # [B+1] row offsets of each item in hidden / captured


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device, backend: str):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.graphs = None  # engine/cuda_graphs.GraphedForward once captured
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    @torch.inference_mode()
    def execute(self, items: list[ForwardItem], capture_layers: list[int] | None = None) -> ForwardResult:
        qlens = np.fromiter((len(it.token_ids) for it in items), dtype=np.int64, count=len(items))
        starts = np.fromiter((it.start_pos for it in items), dtype=np.int64, count=len(items))
        ids = np.fromiter((t for it in items for t in it.token_ids), dtype=np.int64, count=int(qlens.sum()))
        qstart = np.concatenate([[0], np.cumsum(qlens)])
        key = self._graph_key(items, qlens, capture_layers)
        if key is not None:
            logits, hidden, captured = self.graphs.run(key, ids, qlens, starts, [it.block_table for it in items])
            self.num_graph_steps += 1
            return ForwardResult(logits, hidden, captured, qstart)
        self.num_eager_steps += 1
        positions = np.concatenate([np.arange(s, s + q) for s, q in zip(starts, qlens)])
        meta = build_attention_metadata(
            self.backend, [it.block_table for it in items], qlens.tolist(), (starts + qlens).tolist(),
            None, self.block_size, self.device,
        )
        hidden, captured = self.model(
            to_device(ids, self.device), to_device(positions, self.device), self.kv_caches, meta, capture_layers,
        )
        rows = np.concatenate(
            [np.arange(qstart[b + 1] - it.num_logits, qstart[b + 1]) for b, it in enumerate(items)]
            + [np.zeros(0, dtype=np.int64)]
        )
        logits = self.model.compute_logits(hidden[to_device(rows, self.device)])
        return ForwardResult(logits, hidden, captured, qstart)

    def _graph_key(self, items, qlens, capture_layers):
        """A captured graph covers the step when every query row needs logits (decode and
        verification; prefill chunks do not) and the graph captures the layers asked for."""
        g = self.graphs
        if g is None or not len(items) or any(it.num_logits != len(it.token_ids) for it in items):
            return None
        if capture_layers and not set(capture_layers) <= set(g.capture_layers):
            return None
        return g.pick(len(items), int(qlens.max()))
