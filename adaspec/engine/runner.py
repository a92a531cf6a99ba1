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

from adaspec.h2d import to_device, to_device_many
from adaspec.models.attention import build_attention_metadata


def fill_in(ids: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor) -> None:
    """ids[rows] = prev_tokens[src], on the device: inputs the host has not read back yet."""
    ids.index_copy_(0, rows, prev_tokens.index_select(0, src).to(ids.dtype))


@dataclass
class ForwardItem:
    token_ids: list[int]  # query tokens of this request
    start_pos: int  # sequence position of token_ids[0]
    block_table: list[int]
    num_logits: int  # trailing query rows that need logits (0: none)
    # async scheduling: the last query token is still on the device, row prev_row of the tokens
    # the previous step sampled (execute's prev_tokens); -1: token_ids holds every token
    prev_row: int = -1


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [sum num_logits, V] float32, items in order
    hidden: torch.Tensor  # [T, d] final-normed hidden of every query token
    captured: dict[int, torch.Tensor]  # layer id -> [T, d]
    query_start: np.ndarray  # [B+1] row offsets of each item in hidden / captured
    # the device positions and cache slots of the query rows (the first T; views of a graph's
    # static buffers, valid until the next forward): the drafter's context K/V of a plain step
    # goes to the same slots (it shares the block tables) without the host rebuilding them
    positions: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    # the forward's graph also wrote the drafter's context for every query row (cuda_graphs.py,
    # GraphedForward's write_context): a speculative engine has nothing left to write for them
    context_written: bool = False
    # the decode or verify graph (B, Q) the forward replayed, or None (eager, mixed, split): the
    # engine samples a decode graph's rows in the sampling graph of the same B (graphed_sampling.py)
    graph_key: tuple[int, int] | None = None


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
        self.num_split_steps = 0  # mixed steps run as a graph replay plus an eager forward
        self.num_mixed_graph_steps = 0  # mixed steps run as one replay of a mixed graph
        self._splitting = False  # inside _split_mixed: its parts run as the decode graph and eagerly

    @torch.inference_mode()
    def execute(self, items: list[ForwardItem], capture_layers: list[int] | None = None,
                prev_tokens: torch.Tensor | None = None) -> ForwardResult:
        qlens = np.fromiter((len(it.token_ids) for it in items), dtype=np.int64, count=len(items))
        starts = np.fromiter((it.start_pos for it in items), dtype=np.int64, count=len(items))
        ids = np.fromiter((t for it in items for t in it.token_ids), dtype=np.int64, count=int(qlens.sum()))
        qstart = np.concatenate([[0], np.cumsum(qlens)])
        key = self._graph_key(items, qlens, capture_layers)
        if key is None and self.graphs is not None:
            mixed = self._run_mixed_graph(items, ids, qlens, starts, qstart, capture_layers, prev_tokens)
            if mixed is not None:
                return mixed
            split = self._split_mixed(items, capture_layers, prev_tokens)
            if split is not None:
                return split
        fill = self._fill_from_device(items, qstart, prev_tokens)
        if key is not None:
            logits, hidden, captured = self.graphs.run(key, ids, qlens, starts, [it.block_table for it in items], fill)
            self.num_graph_steps += 1
            n = len(ids)
            return ForwardResult(logits, hidden, captured, qstart, self.graphs.positions[:n], self.graphs.slot_mapping[:n],
                                 self.graphs.writes_context, key)
        self.num_eager_steps += 1
        positions = np.concatenate([np.arange(s, s + q) for s, q in zip(starts, qlens)])
        meta = build_attention_metadata(
            self.backend, [it.block_table for it in items], qlens.tolist(), (starts + qlens).tolist(),
            None, self.block_size, self.device,
        )
        logit_rows = np.concatenate(
            [np.arange(qstart[b + 1] - it.num_logits, qstart[b + 1]) for b, it in enumerate(items)]
            + [np.zeros(0, dtype=np.int64)]
        )
        fill_rows, fill_src = (fill[0], fill[1]) if fill is not None else ([], [])
        # one upload (on CUDA each of its own costs a pinned buffer and a launch)
        ids_dev, pos_dev, logit_rows_dev, fill_rows_dev, fill_src_dev = to_device_many(
            [ids, positions, logit_rows, fill_rows, fill_src], self.device)
        if fill is not None:
            fill_in(ids_dev, fill_rows_dev, fill_src_dev, fill[2])
        hidden, captured = self.model(ids_dev, pos_dev, self.kv_caches, meta, capture_layers)
        logits = self.model.compute_logits(hidden[logit_rows_dev])
        return ForwardResult(logits, hidden, captured, qstart, pos_dev, meta.slot_mapping)

    @torch.inference_mode()
    def warm_up(self, scratch_block: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """Run the eager forward (prefill chunks, and whatever the graphs do not cover) once per
        attention tile shape, for one request and for many, so that Triton and torch.compile build
        their variants at start-up rather than stalling the first requests that need them (on the
        H200 the first repeat of every served point was slow until they existed). K/V go to the
        scratch block. -> forwards run."""
        runs = 0
        n = 2
        graphs, self.graphs = self.graphs, None  # the eager path itself, not a mixed graph
        try:
            while n <= min(64, max_num_batched_tokens):
                table = [scratch_block] * -(-n // self.block_size)
                for reqs in sorted({1, max(1, min(max_num_seqs, max_num_batched_tokens // n))}):
                    self.execute([ForwardItem([0] * n, 0, table, 1) for _ in range(reqs)])
                    runs += 1
                n *= 2
        finally:
            self.graphs = graphs
        return runs

    def _run_mixed_graph(self, items, ids, qlens, starts, qstart, capture_layers, prev_tokens) -> ForwardResult | None:
        """A step mixing decodes and prefill chunks (or prefill chunks alone) as one replay of a
        captured mixed graph (cuda_graphs.GraphedForward.run_mixed), when one holds it: every item
        wants at most its last row's logits and the graphs capture the layers asked for."""
        g = self.graphs
        # not for a split step's part: the decode graph's outputs (views of its static buffers,
        # read after the second part) share the capture pool with the mixed graphs, which could
        # reuse that memory as scratch when replayed in between
        if not g.mixed or self._splitting or any(it.num_logits > 1 for it in items):
            return None
        if capture_layers and not set(capture_layers) <= set(g.capture_layers):
            return None
        key = g.pick_mixed(len(items), len(ids))
        if key is None:
            return None
        rows = np.array([qstart[b + 1] - 1 for b, it in enumerate(items) if it.num_logits], dtype=np.int64)
        fill = self._fill_from_device(items, qstart, prev_tokens)
        logits, hidden, captured = g.run_mixed(key, ids, qlens, starts, [it.block_table for it in items], rows, fill)
        self.num_mixed_graph_steps += 1
        n = len(ids)
        return ForwardResult(logits, hidden, captured, qstart, g.positions[:n], g.slot_mapping[:n], g.writes_context)

    def _fill_from_device(self, items, qstart, prev_tokens):
        """(rows of the packed ids, rows of prev_tokens: host arrays, prev_tokens) for the items
        whose last token is still on the device, or None. The graphs stage the two arrays with
        their other inputs (GraphedForward._stage_fill); the eager path copies them itself."""
        pending = [b for b, it in enumerate(items) if it.prev_row >= 0]
        if not pending:
            return None
        if prev_tokens is None:
            raise ValueError("items refer to the previous step's tokens (prev_row), but no prev_tokens were given")
        rows = np.array([qstart[b + 1] - 1 for b in pending], dtype=np.int64)
        src = np.array([items[b].prev_row for b in pending], dtype=np.int64)
        return rows, src, prev_tokens

    def _split_mixed(self, items, capture_layers, prev_tokens=None) -> ForwardResult | None:
        """A step mixing decode rows with prefill chunks: the decode rows replay a graph, the rest
        run eagerly, and the two results are put back in item order. Two forwards instead of
        one, but the eager one is paid anyway and the decode rows keep the graph's speed (with
        continuous arrivals most steps at high concurrency carry a prefill chunk)."""
        decode = [i for i, it in enumerate(items) if it.num_logits == len(it.token_ids)]
        decode = decode[: self.graphs.batch_sizes[-1]]
        if not decode or len(decode) == len(items):
            return None
        # verify rows of a speculative step's eager part count as "decode" here; without a graph
        # for them the split would run two eager forwards where one does
        if self.graphs.pick(len(decode), max(len(items[i].token_ids) for i in decode)) is None:
            return None
        chosen = set(decode)
        rest = [i for i in range(len(items)) if i not in chosen]
        self.num_split_steps += 1
        self._splitting = True
        try:
            parts = [(decode, self.execute([items[i] for i in decode], capture_layers, prev_tokens)),
                     (rest, self.execute([items[i] for i in rest], capture_layers, prev_tokens))]
        finally:
            self._splitting = False
        qlens = np.array([len(it.token_ids) for it in items])
        nlog = np.array([it.num_logits for it in items])
        qstart = np.concatenate([[0], np.cumsum(qlens)])
        lstart = np.concatenate([[0], np.cumsum(nlog)])
        rows = lambda idx, start, n: np.concatenate(  # noqa: E731 (rows of items idx in the merged order)
            [np.arange(start[i], start[i] + n[i]) for i in idx] + [np.zeros(0, dtype=np.int64)])
        first = parts[0][1]
        logits = first.logits.new_empty(int(nlog.sum()), first.logits.shape[-1])
        hidden = first.hidden.new_empty(int(qlens.sum()), first.hidden.shape[-1])
        captured = {k: v.new_empty(int(qlens.sum()), v.shape[-1]) for k, v in first.captured.items()}
        for idx, res in parts:
            lrows, trows = to_device(rows(idx, lstart, nlog), self.device), to_device(rows(idx, qstart, qlens), self.device)
            logits[lrows] = res.logits
            hidden[trows] = res.hidden
            for k in captured:
                captured[k][trows] = res.captured[k]
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
