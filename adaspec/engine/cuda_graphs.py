"""CUDA graphs of the target forward for decode and verification steps.

On the H200 an eager step of any model size costs ~40 ms of Python and kernel launches
(../shared/spec/GPU.md); a graph replays the whole forward in one launch. Graphs are captured at
startup for a grid of request counts B and two query shapes:

- Q = 1: plain decode, one token per request;
- Q = k + 1: verification, where ONE graph per B serves any mix of 0..k drafts per request
  (vLLM's "varlen verification graphs"): the real tokens are packed first, the tail up to
  B * Q is padding, and per-request query starts, key lengths, block tables and slot mappings
  live in static buffers that are refreshed before each replay.

Padding: padded tokens write their K/V to a scratch block that no request owns and their rows
are never read; padded requests have no queries and no keys. The attention kernel's grid depends
only on (B, T), which is what makes one capture valid for every mix of lengths.

Steps the graphs do not cover (prefill chunks, more requests or tokens than captured) run
eagerly through the same model code.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from adaspec.announce import announce
from adaspec.engine.graph_capture import record_graph
from adaspec.engine.runner import fill_in
from adaspec.models.attention import AttentionMetadata


def capture_time_split(seconds: list[float]) -> str:
    """How a capture's time divides: the first graph (which compiles what no earlier graph of the
    process compiled) against the median of the others (each a warm-up forward, a captured forward
    and the graph's instantiation). A server's start on the H200 spent 79 of its 112 s capturing
    (BENCHMARKS.md, run 27); this says which part to cut."""
    if not seconds:
        return "no graph captured"
    if len(seconds) == 1:
        return f"one graph, {seconds[0]:.2f} s"
    rest = sorted(seconds[1:])
    median = rest[len(rest) // 2] if len(rest) % 2 else 0.5 * (rest[len(rest) // 2 - 1] + rest[len(rest) // 2])
    return f"first graph {seconds[0]:.2f} s, the others {1e3 * median:.0f} ms each (median), {sum(rest):.1f} s in all"


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (as vLLM's default capture sizes)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def mixed_pad_limit(num_tokens: int) -> int:
    """The most padding a mixed graph may add to a step of num_tokens: max(128, num_tokens / 4).
    A large step is compute-bound, so padding costs it more than the eager launches a graph saves;
    a small one is launch-bound (an eager forward of the 0.6B shape takes ~20 ms at any size)."""
    return max(128, num_tokens // 4)


def mixed_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """(B, T) of the mixed graphs: B = 16 and max_num_seqs (a padded request costs one empty
    attention program), T = 64, 192, 320, ... up to the step's token budget, each T the previous
    plus mixed_pad_limit(previous) rounded down to a multiple of 64, so that EVERY step size has a
    graph within the pad limit. (A coarser 1.5x / 2x grid left gaps: on the H200 a speculative
    step's prefill chunk, the budget left after 8 tokens per verifying request, fell in them in
    ~20 of 77 steps at C = 256 and ran eagerly at ~25 ms; BENCHMARKS.md, run 8.)"""
    bs = sorted({min(16, max_num_seqs), max_num_seqs})
    ts, t = [], 64
    while t < max_num_batched_tokens:
        ts.append(t)
        t += mixed_pad_limit(t) // 64 * 64
    ts.append(max_num_batched_tokens)
    # the capture's dummy requests share T evenly: none may be longer than the model allows
    return [(b, t) for b in bs for t in ts if -(-t // b) <= max_model_len]


class _Graph:
    """A captured graph and its static outputs; `graph=None` replays by running the forward
    eagerly over the same static buffers (CPU tests of the buffer logic, see capture(eager=True))."""

    def __init__(self, graph, outputs, forward=None):
        self.graph, self.outputs, self.forward = graph, outputs, forward

    def replay(self):
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.outputs


def device_memory_held(device) -> int:
    """Bytes of the device's memory in use, cached-but-free allocator blocks excluded. Entering
    torch.cuda.graph empties the allocator's cache, so a before/after difference of raw free
    memory counts the blocks that released as negative use; emptying it here first does not."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def release_graphs(graphs: dict) -> int:
    """Free the captured graphs of a {key: _Graph} dict and empty it. -> how many were freed.
    Under tensor parallelism this must happen before the process group is destroyed: a live graph
    holding NCCL collectives makes destroy_process_group hang (pytorch#115388; freeing the graphs
    first is the workaround Megatron-Bridge adopted)."""
    n = 0
    for g in graphs.values():
        if g.graph is not None:
            g.graph.reset()
            n += 1
        g.outputs = g.forward = None
    graphs.clear()
    return n


class GraphedForward:
    """Static input buffers, the captured graphs, and the per-step refresh of the buffers."""

    def __init__(self, model, kv_caches, block_size: int, device: torch.device, max_num_seqs: int,
                 query_lens: tuple[int, ...], max_model_len: int, max_blocks_per_seq: int, scratch_block: int,
                 capture_layers: list[int] | None, batch_sizes: list[int] | None = None,
                 mixed_sizes: list[tuple[int, int]] | None = None, write_context=None, backend: str = "triton"):
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        # the attention backend the graphs run: the Triton kernel (its grid depends on (B, T) only);
        # "paged_torch" (its contract in plain torch) for CPU tests of code that captures eagerly
        self.backend = backend
        # write_context(captured, positions, slot_mapping): a speculative engine's drafter context
        # write (spec_decode/step.DrafterSetup), run inside every graph after the forward, for all
        # T rows (padding writes the scratch block). A plain step of adaptive speculation then costs
        # the plain engine's one replay: run eagerly after it, the write's ~20 launches made that
        # step host-bound at 1-16 requests on the H200 (BENCHMARKS.md, run 11)
        self.write_context = write_context
        self.writes_context = write_context is not None
        self.query_lens = tuple(sorted(set(query_lens)))
        self.max_model_len = max_model_len
        self.capture_layers = list(capture_layers or [])
        self.batch_sizes = sorted(batch_sizes) if batch_sizes else capture_sizes(max_num_seqs)
        self.scratch_block = scratch_block
        # mixed graphs (B requests, T tokens): decodes and prefill chunks in one replay, logits for
        # each request's last row only, the capture layers' hidden states of every row (the
        # speculative engine writes the drafter's context from them)
        self.mixed_sizes = sorted(set(mixed_sizes or []), key=lambda bt: (bt[1], bt[0]))
        max_b = max([self.batch_sizes[-1]] + [b for b, _ in self.mixed_sizes])
        max_t = max([self.batch_sizes[-1] * self.query_lens[-1]] + [t for _, t in self.mixed_sizes])
        self.max_blocks = max_blocks_per_seq
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_t, **i64)
        self.positions = torch.zeros(max_t, **i64)
        self.slot_mapping = torch.zeros(max_t, **i64)
        self.query_start = torch.zeros(max_b + 1, **i32)
        self.kv_lens = torch.zeros(max_b, **i32)
        self.block_tables = torch.zeros(max_b, max_blocks_per_seq, **i32)
        self.logit_rows = torch.zeros(max_b, **i64)  # mixed graphs: the row of each request's logits
        # async scheduling: packed rows whose token comes from the previous step's output, and where
        self.fill_rows = torch.zeros(max_b, **i64)
        self.fill_src = torch.zeros(max_b, **i64)
        # pinned host mirrors, filled with numpy and copied asynchronously: two sets used in turn,
        # since under async scheduling step t's are filled while step t-1's copies may be in flight
        self.mirrors = [_HostMirrors(max_t, max_b, max_blocks_per_seq, device) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mixed: dict[tuple[int, int], _Graph] = {}  # (B, T) -> graph
        self.capture_seconds: list[float] = []  # wall time of each graph's capture, in capture order
        self.pool = None

    # -- capture -------------------------------------------------------------------------------
    def _meta(self, b: int, t: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(
            backend=self.backend, slot_mapping=self.slot_mapping[:t], num_seqs=b, max_q=q, max_k=self.max_model_len,
            cu_q=self.query_start[: b + 1], block_tables=self.block_tables[:b], kv_lens=self.kv_lens[:b],
            causal=True, block_size=self.block_size,
        )

    def _forward(self, b: int, t: int, q: int):
        hidden, captured = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, self._meta(b, t, q),
                                      self.capture_layers)
        self._write_context(captured, t)
        return self.model.compute_logits(hidden), hidden, captured

    def _write_context(self, captured, t: int) -> None:
        if self.write_context is not None:
            self.write_context(captured, self.positions[:t], self.slot_mapping[:t])

    def _forward_mixed(self, b: int, t: int):
        """Any mix of query lengths summing to at most T over at most B requests (the kernel's grid
        depends on (B, T) only; its tile shape is the one for long queries). No logits: run_mixed
        computes them after the replay for the rows that need them, so the graphs hold no [B, vocab]
        outputs (155 MB each for B = 256 and a 152k vocabulary)."""
        hidden, captured = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, self._meta(b, t, t),
                                      self.capture_layers)
        self._write_context(captured, t)
        return hidden, captured

    def _dummy_inputs(self, b: int, t: int) -> None:
        """Capture inputs: t tokens shared evenly by b requests, at positions 0.. of the scratch block."""
        lens = torch.full((b,), t // b, device=self.device, dtype=torch.int32)
        lens[: t % b] += 1
        starts = torch.zeros(b + 1, device=self.device, dtype=torch.int32)
        starts[1:] = lens.cumsum(0)
        self.query_start[: b + 1] = starts
        req = torch.repeat_interleave(torch.arange(b, device=self.device), lens.long())
        self.positions[:t] = torch.arange(t, device=self.device) - starts[req].long()
        self.input_ids[:t].zero_()
        self.slot_mapping[:t] = self.scratch_block * self.block_size + self.positions[:t] % self.block_size
        self.kv_lens[:b] = lens

    def _capture_one(self, forward) -> _Graph:
        t0 = time.perf_counter()
        forward()  # warm-up: Triton compiles, allocator settles
        torch.cuda.synchronize(self.device)
        g, outputs = record_graph(forward, pool=self.pool)
        if self.pool is None:
            self.pool = g.pool()
        self.capture_seconds.append(time.perf_counter() - t0)
        return _Graph(g, outputs)

    @torch.inference_mode()
    def capture(self, eager: bool = False) -> None:
        """Capture every (B, Q) graph. eager=True captures nothing and replays run the forward
        eagerly on the static buffers: the same padding and buffer logic, testable on CPU."""
        if eager:
            for q in self.query_lens:
                for b in self.batch_sizes:
                    self.graphs[(b, q)] = _Graph(None, None, lambda b=b, q=q: self._forward(b, b * q, q))
            for b, t in self.mixed_sizes:
                self.mixed[(b, t)] = _Graph(None, None, lambda b=b, t=t: self._forward_mixed(b, t))
            return
        t0 = time.perf_counter()
        held0 = device_memory_held(self.device)
        self.capture_seconds = []
        self.block_tables.fill_(self.scratch_block)
        try:
            for b, t in reversed(self.mixed_sizes):  # largest first: later graphs reuse its pool
                self._dummy_inputs(b, t)
                self.mixed[(b, t)] = self._capture_one(lambda b=b, t=t: self._forward_mixed(b, t))
        except (RuntimeError, torch.OutOfMemoryError) as e:
            # the mixed graphs are an optimization: without them mixed steps run split, as before
            release_graphs(self.mixed)
            self.mixed_sizes, self.pool = [], None
            torch.cuda.synchronize(self.device)
            announce(f"WARNING: capturing the mixed CUDA graphs failed ({type(e).__name__}: {str(e)[:200]}); "
                     "steps with prefill chunks run as a decode graph plus an eager forward")
        for q in reversed(self.query_lens):
            for b in reversed(self.batch_sizes):
                self._dummy_inputs(b, b * q)
                self.graphs[(b, q)] = self._capture_one(lambda b=b, q=q: self._forward(b, b * q, q))
        used = (device_memory_held(self.device) - held0) / 2**20
        mixed = f" and {len(self.mixed)} mixed (requests x tokens {self.mixed_sizes})" if self.mixed else ""
        announce(f"captured {len(self.graphs)} CUDA graphs (requests {_ranges(self.batch_sizes)} x query tokens "
                 f"{list(self.query_lens)}){mixed} in {time.perf_counter() - t0:.1f} s, {used:.0f} MiB "
                 f"({capture_time_split(self.capture_seconds)})")

    def release(self) -> int:
        """Free every captured graph and the pool (see release_graphs); the engine then runs eagerly."""
        n = release_graphs(self.graphs) + release_graphs(self.mixed)
        self.pool = None
        return n

    # -- replay --------------------------------------------------------------------------------
    def pick(self, num_requests: int, max_query: int) -> tuple[int, int] | None:
        """The captured (B, Q) that covers a batch, or None (run eagerly)."""
        q = next((x for x in self.query_lens if x >= max_query), None)
        if q is None or num_requests > self.batch_sizes[-1]:
            return None
        b = next(x for x in self.batch_sizes if x >= num_requests)
        return b, q

    def pick_mixed(self, num_requests: int, num_tokens: int) -> tuple[int, int] | None:
        """The smallest captured mixed (B, T) that holds the step, or None, also when it would pad
        by more than mixed_pad_limit(T) tokens."""
        key = next(((b, t) for b, t in self.mixed_sizes if b >= num_requests and t >= num_tokens), None)
        if key is None or key[1] - num_tokens > mixed_pad_limit(num_tokens):
            return None
        return key

    def run_mixed(self, key: tuple[int, int], ids: np.ndarray, qlens: np.ndarray, starts: np.ndarray,
                  block_tables: list[list[int]], logit_rows: np.ndarray, fill=None):
        """As run, for a mixed graph: logit_rows are the packed rows whose logits are wanted, in
        order. Returns (logits of those rows, hidden of the first T rows, captured)."""
        b_pad, t_pad = key
        m = self._refresh(b_pad, t_pad, ids, qlens, starts, block_tables)
        n_logits = len(logit_rows)
        m.lr.numpy()[:n_logits] = logit_rows
        self.logit_rows[:n_logits].copy_(m.lr[:n_logits], non_blocking=True)
        self._stage_fill(m, fill)
        hidden, captured = self.mixed[key].replay()
        logits = self.model.compute_logits(hidden.index_select(0, self.logit_rows[:n_logits]))
        n_tok = len(ids)
        return logits, hidden[:n_tok], {k: v[:n_tok] for k, v in captured.items()}

    def run(self, key: tuple[int, int], ids: np.ndarray, qlens: np.ndarray, starts: np.ndarray,
            block_tables: list[list[int]], fill=None):
        """Refresh the static buffers for this step's real tokens and requests, then replay.
        ids: the packed query tokens; request r has qlens[r] of them at positions starts[r]...
        fill: (rows, src: host arrays, prev_tokens on the device): input rows taken from the
        previous step's sampled tokens (async scheduling; runner.fill_in). Returns views (logits,
        hidden, captured) of the first T rows, valid until the next run."""
        b_pad, q = key
        m = self._refresh(b_pad, b_pad * q, ids, qlens, starts, block_tables)
        self._stage_fill(m, fill)
        logits, hidden, captured = self.graphs[key].replay()
        n_tok = len(ids)
        return logits[:n_tok], hidden[:n_tok], {k: v[:n_tok] for k, v in captured.items()}

    def _stage_fill(self, m: "_HostMirrors", fill) -> None:
        """Copy the fill rows with the step's other inputs (no allocation per step), close the
        mirrors' copies, then take those input tokens from the previous step's output."""
        if fill is None:
            m.mark_copied()
            return
        rows, src, prev = fill
        n = len(rows)
        m.fill.numpy()[:, :n] = (rows, src)
        self.fill_rows[:n].copy_(m.fill[0, :n], non_blocking=True)
        self.fill_src[:n].copy_(m.fill[1, :n], non_blocking=True)
        m.mark_copied()
        fill_in(self.input_ids, self.fill_rows[:n], self.fill_src[:n], prev)

    def _refresh(self, b_pad: int, t_pad: int, ids, qlens, starts, block_tables) -> "_HostMirrors":
        """Fill this step's pinned mirrors and start their copies into the static buffers.
        -> the mirrors (the caller adds its own copies, then marks them copied)."""
        m = self.mirrors[self._turn]
        self._turn ^= 1
        m.wait_until_copied()  # the copies of two steps ago: done long since, but never overwritten early
        n_req, n_tok = len(qlens), len(ids)
        bs, scratch = self.block_size, self.scratch_block
        width = max(len(row) for row in block_tables)
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks exceeds the captured width {self.max_blocks}")
        bt = m.bt.numpy()
        bt[:b_pad, :width] = scratch
        if isinstance(block_tables, np.ndarray):  # rows of one width (self-distillation's batches): one copy
            bt[:n_req, :width] = block_tables
        else:
            for r, row in enumerate(block_tables):
                bt[r, : len(row)] = row
        req = np.repeat(np.arange(n_req), qlens)
        pos = np.arange(n_tok) - np.repeat(np.cumsum(qlens) - qlens, qlens) + np.repeat(starts, qlens)
        h = m.i64.numpy()
        h[0, :n_tok], h[1, :n_tok] = ids, pos
        h[2, :n_tok] = bt[req, pos // bs].astype(np.int64) * bs + pos % bs
        h[0, n_tok:t_pad] = 0
        h[1, n_tok:t_pad] = 0
        h[2, n_tok:t_pad] = scratch * bs  # padding writes to the scratch block
        qs, kvl = m.qs.numpy(), m.kvl.numpy()
        qs[0] = 0
        np.cumsum(qlens, out=qs[1: n_req + 1])
        qs[n_req + 1: b_pad + 1] = n_tok
        kvl[:n_req] = starts + qlens
        kvl[n_req:b_pad] = 0
        self.input_ids[:t_pad].copy_(m.i64[0, :t_pad], non_blocking=True)
        self.positions[:t_pad].copy_(m.i64[1, :t_pad], non_blocking=True)
        self.slot_mapping[:t_pad].copy_(m.i64[2, :t_pad], non_blocking=True)
        self.query_start[: b_pad + 1].copy_(m.qs[: b_pad + 1], non_blocking=True)
        self.kv_lens[:b_pad].copy_(m.kvl[:b_pad], non_blocking=True)
        self.block_tables[:b_pad, :width].copy_(m.bt[:b_pad, :width], non_blocking=True)
        return m


class _HostMirrors:
    """One set of pinned host buffers for the static inputs, and the event after their copies."""

    def __init__(self, max_t: int, max_b: int, max_blocks: int, device: torch.device):
        pin = dict(pin_memory=device.type == "cuda")
        self.i64 = torch.zeros(3, max_t, dtype=torch.int64, **pin)  # input ids, positions, slots
        self.qs = torch.zeros(max_b + 1, dtype=torch.int32, **pin)
        self.kvl = torch.zeros(max_b, dtype=torch.int32, **pin)
        self.bt = torch.zeros(max_b, max_blocks, dtype=torch.int32, **pin)
        self.lr = torch.zeros(max_b, dtype=torch.int64, **pin)  # logit rows of a mixed graph
        self.fill = torch.zeros(2, max_b, dtype=torch.int64, **pin)  # rows, source rows (async scheduling)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.pending = False

    def mark_copied(self) -> None:
        if self.copied is not None:
            self.copied.record()
            self.pending = True

    def wait_until_copied(self) -> None:
        if self.pending:
            self.copied.synchronize()
            self.pending = False


def _ranges(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]} ({len(sizes)} sizes)" if len(sizes) > 3 else str(sizes)
