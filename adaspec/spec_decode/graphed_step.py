"""CUDA graphs of the speculative step's decode path: propose, then verify-and-accept, one read back.

For the requests of a step that decode one token (the speculative step hands any others, e.g.
prefill chunks, to its eager path in the same engine step), the step is at most two graph replays
and one device-to-host copy (rows with top-k / top-p, logits rules or logprobs add a few eager
kernels after the verify replay, and ruled rows one more wait, for their drafts: graphed_extras.py):

1. ``propose[B]``: the drafter's backbone pass, Markov loop and confidences for B (padded)
   requests, then each request's query count ``1 + l_r``: the reserved slots (fixed k) or
   ``allocate_torch(survival(conf), B*, slots)`` (adaptive; B* was chosen on the host from the
   previous step's confidences, policy.py, so no current draft is read back first);
2. ``verify[B, Q]``: the packed layout is built ON THE DEVICE from (last token, its position,
   query count, drafts) per request, since the host does not know the adaptive lengths; then the
   target forward over B*Q token rows (the real ones first, padding into the scratch block), the
   drafter's context K/V of every row (rows of rejected drafts too: their positions lie inside the
   next draft block, which overwrites them before anything reads them), rejection sampling, and
   tokens, accept counts, query counts and confidences packed into one buffer;
3. one copy of that buffer to the host: the step's only device-to-host sync.

Graph keys: B over the capture sizes; Q over query-length levels: for a fixed k, 1 (steps that do
not draft), about 1 + k/4, 1 + k/2 and k + 1; for an adaptive k, every Q from 1 to k + 1. One graph
covers any mix of per-request lengths whose total is at most B*Q (the attention kernel's grid
depends on (B, T) only), so an adaptive budget that verifies few drafts runs a smaller graph and
saves the target's compute. The adaptive step needs every level because it pays the padded B*Q
(GraphPaddedCost): with k = 7's coarse levels 1, 3, 5, 8 a budget of 3 drafts per request ran,
and was priced as, 5 query tokens, so the policy took 4 drafts where fixed k = 3 runs 4 tokens
exactly; replaying the cost tables of H200 run 17 (benchmarks/replay_policy.py) shows the choice
at the Qwen3-8B shape at 64 requests and the 0.6B pair at 256, where fixed k = 3 led.

`capture(eager=True)` captures nothing: replays run the same functions eagerly over the same
static buffers (CPU tests of everything but the capture itself).
"""
from __future__ import annotations

import math
import time
import weakref

import numpy as np
import torch

from adaspec.announce import announce
from adaspec.cuda_compiled import cuda_compiled
from adaspec.engine.cuda_graphs import (
    _Graph, _ranges, capture_sizes, capture_time_split, device_memory_held, release_graphs,
)
from adaspec.engine.graph_capture import record_graph
from adaspec.models.attention import AttentionMetadata
from adaspec.sample.probs import probs_and_argmax, processed_probs, sample_from_logits, sample_tokens
from adaspec.sample.random import SAMPLE, keyed_uniforms
from adaspec.sample.rejection import rejection_sample
from adaspec.spec_decode import graphed_extras
from adaspec.spec_decode.cost_model import WrappedCost
from adaspec.spec_decode.policy import allocate_torch, survival_torch


def query_levels(k: int, every: bool = False) -> list[int]:
    """Captured query tokens per request: 1 (no drafts), then ~1 + k/4, ~1 + k/2 and k + 1; with
    every=True (the adaptive step, see the module's docstring) each of 1 .. k + 1."""
    if every:
        return list(range(1, k + 2))
    return sorted({1, *(1 + max(1, math.ceil(k * f)) for f in (0.25, 0.5, 1.0))})


class StaticSampling:
    """The device half of a SamplingBatch over static buffers, for code inside a graph: rows may
    be greedy (temperature 0) or sampled; no top-k / top-p (rows with them are redone after the
    replay: graphed_extras.py)."""

    any_filter = False  # what SamplingBatch says when no row has top-k / top-p

    def __init__(self, temperature: torch.Tensor, seeds: torch.Tensor, all_greedy: bool = False):
        self.temperature, self.seeds, self.all_greedy = temperature, seeds, all_greedy
        self._no_filter: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _filters_off(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_p = 1, top_k = 0) per row, made once per row count: the drafter draws k times per
        step, and two fills per draw were 2k kernels of the propose graph."""
        n = t.shape[0]
        if n not in self._no_filter:
            self._no_filter[n] = (torch.ones_like(t), torch.zeros_like(t, dtype=torch.long))
        return self._no_filter[n]

    def probs(self, logits: torch.Tensor, temperature: torch.Tensor | None = None,
              index: torch.Tensor | None = None) -> torch.Tensor:
        """index: the rows of logits to process (processed_probs); temperature is then per output row."""
        t = self.temperature if temperature is None else temperature
        return processed_probs(logits, t, *self._filters_off(t), any_filter=False, any_greedy=True, index=index)

    def draw(self, logits: torch.Tensor, uniforms: torch.Tensor, out: torch.Tensor | None = None):
        t = self.temperature
        return sample_from_logits(logits, t, *self._filters_off(t), uniforms, any_filter=False, any_greedy=True,
                                  out=out)


@cuda_compiled  # ~35 small kernels as torch ops (adaspec/cuda_compiled.py)
def packed_layout(nq, start, last_tok, drafts, block_tables, block_size: int, scratch_slot: int, num_tokens: int):
    """Token rows of a step whose request r runs nq[r] query tokens (its last token, then nq[r] - 1
    drafts) from position start[r]; rows past the real total are padding (token 0, position 0,
    the scratch slot). All device ops: -> (ids, positions, slots, request of each row, query_start
    int32 [B+1], kv_lens int32 [B])."""
    dev = nq.device
    cu = torch.cumsum(nq, 0)
    t = torch.arange(num_tokens, device=dev)
    req = torch.searchsorted(cu, t, right=True).clamp_max(nq.shape[0] - 1)
    row = t - (cu[req] - nq[req])
    valid = t < cu[-1]
    if drafts.shape[1]:
        from_draft = drafts[req, (row - 1).clamp(0, drafts.shape[1] - 1)]
        ids = torch.where(row == 0, last_tok[req], from_draft)
    else:
        ids = last_tok[req]
    pos = torch.where(valid, start[req] + row, torch.zeros_like(row))
    slots = block_tables[req, pos // block_size].long() * block_size + pos % block_size
    slots = torch.where(valid, slots, torch.full_like(slots, scratch_slot))
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    query_start = torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), cu.int()])
    kv_lens = torch.where(nq > 0, start + nq, torch.zeros_like(nq)).int()
    return ids, pos, slots, req, query_start, kv_lens


@cuda_compiled
def draft_block_slots(anchors: torch.Tensor, block_tables: torch.Tensor, block: int, block_size: int):
    """-> (the cache slot of every draft block position, flat [B * block]; int32 [B] keys each
    block query sees: its anchor position + block; the positions, flat [B * block])."""
    pos = anchors[:, None] + torch.arange(block, device=anchors.device)
    slots = block_tables.gather(1, pos // block_size).long() * block_size + pos % block_size
    return slots.reshape(-1), (anchors + block).int(), pos.reshape(-1)


@cuda_compiled  # ~20 small kernels as torch ops
def query_counts(nq: torch.Tensor, limits: torch.Tensor, conf: torch.Tensor, budget: torch.Tensor,
                 adaptive: bool) -> torch.Tensor:
    """Each request's query tokens for the verify graph: 1 + its drafts to verify, which are its
    limit (fixed k) or the adaptive budget's best slots by survival probability
    (policy.allocate_torch, capped at the limits); padding requests (nq = 0) keep none, since a
    token more would push the packed rows past the B*Q the verify graph was captured for."""
    verified = allocate_torch(survival_torch(conf), budget, limits) if adaptive else limits
    return torch.where(nq > 0, 1 + verified, torch.zeros_like(verified))


@cuda_compiled
def verify_rows(query_start: torch.Tensor, nq: torch.Tensor, req: torch.Tensor, temps: torch.Tensor, K: int,
                total: int):
    """-> ([B, K + 1] the packed row of each request's K + 1 verify positions (its last row
    repeated past its query count), [B] its drafts to verify, [B * (K + 1)] the temperature of
    each of those rows' requests, [B] greedy requests). req: the request of each packed row. The
    last two as torch ops outside were three kernels of the verify graph."""
    n_verify = (nq - 1).clamp_min(0)
    first = query_start[:-1].long()
    rows = first[:, None] + torch.minimum(torch.arange(K + 1, device=nq.device)[None, :], n_verify[:, None])
    rows = rows.clamp(0, total - 1)
    return rows, n_verify, temps[req[rows.reshape(-1)]], temps <= 0


@cuda_compiled
def readback_rows(tokens: torch.Tensor, n_acc: torch.Tensor, nq: torch.Tensor, start: torch.Tensor, k: int):
    """-> (the read back's first k + 3 columns per request: k + 1 output tokens (-1 padding),
    accepted drafts, query count; the carry: last emitted token, its position, accepted drafts).
    tokens: [B, K + 1] with K = k, or K = 0 for a step without drafts."""
    B, width = tokens.shape
    padded = torch.cat([tokens, torch.full((B, k + 1 - width), -1, dtype=tokens.dtype, device=tokens.device)], 1)
    packed = torch.cat([padded, n_acc[:, None], nq[:, None]], 1)
    last = tokens.gather(1, n_acc[:, None]).squeeze(1)
    return packed, torch.stack([last, start + 1 + n_acc, n_acc], 1)


class GraphedSpecStep:
    def __init__(self, decoder, engine, batch_sizes: list[int] | None = None):
        # weak: the decoder holds this step (decoder.graphed), as the engine holds the decoder
        # (SpeculativeDecoder.__init__ says why no cycle may hold them)
        self.decoder, self.engine = weakref.proxy(decoder), weakref.proxy(engine)
        self.model, self.drafter = engine.model, decoder.drafter
        self.k, self.block = decoder.num_spec_tokens, decoder.block
        self.adaptive = bool(decoder.cfg.enable_adaptive_verification)
        self.greedy_drafts = decoder.greedy_drafts
        self.capture_layers = list(decoder.capture_layers)
        self.block_size = bs = engine.config.block_size
        self.scratch_slot = engine.scratch_block * bs
        self.max_k = engine.max_model_len + self.block
        self.width = -(-self.max_k // bs)
        self.batch_sizes = sorted(batch_sizes) if batch_sizes else capture_sizes(engine.config.max_num_seqs)
        self.levels = query_levels(self.k, every=self.adaptive)
        self.widths = decoder.draft_widths  # a propose graph per draft width (policy.draft_widths)
        # the Triton kernel on CUDA; its torch twin (same metadata) for the CPU tests
        self.backend = "triton" if engine.attention_backend == "triton" else "paged_torch"
        dev, k, bmax = engine.device, self.k, self.batch_sizes[-1]
        V = engine.model_config.vocab_size
        self.device = dev
        i64 = dict(dtype=torch.int64, device=dev)
        # inputs, rewritten every step from pinned host mirrors: last token, its position, draft
        # slots the request may use, query count, seed; then the block tables and temperatures
        self.inputs = torch.zeros(5, bmax, **i64)
        self.last_tok, self.start, self.slots, self.nq, self.seeds = self.inputs.unbind(0)
        self.budget = torch.zeros((), **i64)
        self.block_tables = torch.zeros(bmax, self.width, dtype=torch.int32, device=dev)
        self.temperature = torch.zeros(bmax, dtype=torch.float32, device=dev)
        # the propose graph's outputs, read by the verify graph
        self.drafts = torch.zeros(bmax, k, **i64)
        self.conf = torch.ones(bmax, k, dtype=torch.float32, device=dev)
        self.draft_q = None if self.greedy_drafts else torch.zeros(bmax, k, V, dtype=torch.float32, device=dev)
        # what the host reads back: k + 1 tokens, accepted drafts, query count, k confidence bits;
        # copied into a pinned mirror right after the replays, so that work the engine queues
        # behind them (a mixed step's prefill forward) need not finish before the host reads it
        self.readback = torch.zeros(bmax, 2 * k + 3, **i64)
        # the verify forward's final hidden states (B*Q rows), for the rows whose part of the step
        # is redone after the replay (top-k / top-p, logprobs: graphed_extras.py)
        self.verify_hidden = torch.zeros(bmax * (k + 1), engine.model_config.hidden_size, dtype=engine.dtype,
                                         device=dev)
        # what the next step takes on the device when it is launched before this one is read back
        # (pipelined steps): each request's last emitted token, that token's position, drafts accepted
        self.carry = torch.zeros(bmax, 3, **i64)
        self.carried = torch.zeros(3, bmax, **i64)  # rows that take it, their rows in the carry, remaining
        self.first_rows = torch.zeros(2, bmax, **i64)  # rows whose token a prefill sampled, its row there
        # pinned host mirrors of the inputs and of the read back: two sets used in turn, since under
        # pipelining a step is launched while the previous one's copies may still be queued
        self.mirrors = [_SpecMirrors(bmax, k, self.width, dev) for _ in range(2)]
        self._next_mirror = 0
        # (rows, mirrors, the extras rows' logprobs on the host or None) launched, oldest first
        self._launched: list[tuple[int, "_SpecMirrors", tuple | None]] = []
        self.num_read_backs = 0  # event waits for results (CUDA's sync debug mode does not see them)
        self.arange_block = torch.arange(bmax + 1, dtype=torch.int32, device=dev) * self.block
        self.propose_graphs: dict[tuple[int, int], _Graph] = {}  # (requests, draft width)
        self.verify_graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None

    # -- the two captured functions --------------------------------------------------------------
    def _propose(self, b: int, w: int | None = None) -> None:
        """Draft w slots (default k) of b requests; the slots past w get NaN confidences (the host's
        policy keeps its old ones for them) and are capped off by the limits."""
        blk, bs, k = self.block, self.block_size, self.k
        w = k if w is None else w
        anchors, ids, bt = self.start[:b], self.last_tok[:b], self.block_tables[:b]
        slots, kv_lens, positions = draft_block_slots(anchors, bt, blk, bs)
        meta = AttentionMetadata(
            backend=self.backend, slot_mapping=slots, num_seqs=b, max_q=blk, max_k=self.max_k,
            cu_q=self.arange_block[: b + 1], block_tables=bt, kv_lens=kv_lens, causal=False, block_size=bs,
        )
        h = self.drafter.backbone_forward(ids, anchors, meta, self.decoder.kv_caches, positions=positions)
        temps = torch.zeros_like(self.temperature[:b]) if self.greedy_drafts else self.temperature[:b]
        sampling = StaticSampling(temps, self.seeds[:b], all_greedy=self.greedy_drafts)
        # heads for the w slots only; the draft distributions go straight into the static buffer
        q_out = None if self.draft_q is None else self.draft_q[:b, :w]
        prop = self.drafter.draft_block(h, ids, anchors, sampling, width=w, probs_out=q_out)
        self.drafts[:b, :w].copy_(prop.tokens)
        self.conf[:b, :w].copy_(prop.confidences)
        if w < k:
            self.conf[:b, w:].fill_(float("nan"))
        if q_out is not None and prop.probs.data_ptr() != q_out.data_ptr():
            q_out.copy_(prop.probs)  # a drafter that did not write into probs_out
        limits = self.slots[:b].clamp(max=w)  # the host capped them already; this keeps the graph safe
        self.nq[:b].copy_(query_counts(self.nq[:b], limits, prop.confidences, self.budget, self.adaptive))

    def _verify(self, b: int, q: int) -> None:
        K = self.k if q > 1 else 0
        nq, start, temps, seeds = self.nq[:b], self.start[:b], self.temperature[:b], self.seeds[:b]
        ids, pos, slots, req, query_start, kv_lens = packed_layout(
            nq, start, self.last_tok[:b], self.drafts[:b, :K], self.block_tables[:b], self.block_size,
            self.scratch_slot, b * q,
        )
        meta = AttentionMetadata(
            backend=self.backend, slot_mapping=slots, num_seqs=b, max_q=q, max_k=self.max_k, cu_q=query_start,
            block_tables=self.block_tables[:b], kv_lens=kv_lens, causal=True, block_size=self.block_size,
        )
        hidden, captured = self.model(ids, pos, self.engine.kv_caches, meta, self.capture_layers)
        self.decoder.setup.write_context(captured, pos, slots)
        self.verify_hidden[: b * q].copy_(hidden)
        rb = self.readback[:b]
        if K == 0:  # no drafts: sample each request's next token from its last row
            last = (torch.cumsum(nq, 0) - 1).clamp_min(0)
            logits = self.model.compute_logits(hidden[last])
            tokens = sample_tokens(logits, temps, keyed_uniforms(seeds, start + 1, SAMPLE))[:, None]
            n_acc = torch.zeros_like(start)
        else:
            logits = self.model.compute_logits(hidden)  # [B*Q, V]: every row, then the verify rows
            rows, n_verify, row_temps, greedy = verify_rows(query_start, nq, req, temps, K, b * q)
            # the verify rows' distributions, each with its request's temperature, gathered by the
            # sampler (no copy of the [B*Q, V] logits or probabilities), and their raw argmax (the
            # greedy rows' accept test) from the same kernel
            p, argmax = probs_and_argmax(logits, row_temps, index=rows.reshape(-1))
            p, argmax = p.view(b, K + 1, -1), argmax.view(b, K + 1)
            accept = getattr(self.drafter, "accept", None)  # synthetic: the curve decides
            fused = {} if accept else {"fused": True}  # compiled halves: this capture's warm-up compiles them
            out = (accept or rejection_sample)(self.drafts[:b], n_verify, p,
                                               None if self.draft_q is None else self.draft_q[:b], greedy, seeds,
                                               start, target_argmax=argmax, **fused)
            tokens, n_acc = out.output_tokens, out.num_accepted.long()
        packed, carry = readback_rows(tokens, n_acc, nq, start, self.k)
        rb[:, : self.k + 3].copy_(packed)
        self.carry[:b].copy_(carry)
        rb[:, self.k + 3:] = self.conf[:b].view(torch.int32).long()

    # -- capture -------------------------------------------------------------------------------
    def _dummy_inputs(self, b: int, q: int) -> None:
        """Every request decodes at position 0 of the scratch block with q - 1 drafts."""
        self.block_tables.fill_(self.engine.scratch_block)
        self.inputs.zero_()
        self.slots[:b] = q - 1
        self.nq[:b] = q
        self.budget.fill_(b * (q - 1))
        self.temperature.fill_(1.0)

    @torch.inference_mode()
    def capture(self, eager: bool = False) -> None:
        if eager:
            for b in self.batch_sizes:
                for w in self.widths:
                    self.propose_graphs[(b, w)] = _Graph(None, None, lambda b=b, w=w: self._propose(b, w))
                for q in self.levels:
                    self.verify_graphs[(b, q)] = _Graph(None, None, lambda b=b, q=q: self._verify(b, q))
            return
        t0 = time.perf_counter()
        held0 = device_memory_held(self.device)
        seconds = []  # each graph's capture, for capture_time_split
        for b in reversed(self.batch_sizes):  # largest first: later graphs reuse its pool
            jobs = [("propose", w) for w in reversed(self.widths)] + [("verify", q) for q in reversed(self.levels)]
            for kind, n in jobs:
                fn = (lambda b=b, w=n: self._propose(b, w)) if kind == "propose" else \
                    (lambda b=b, q=n: self._verify(b, q))
                t_graph = time.perf_counter()
                self._dummy_inputs(b, self.k + 1 if kind == "propose" else n)
                fn()  # warm-up: Triton and torch.compile compile, the allocator settles
                torch.cuda.synchronize(self.device)
                g, _ = record_graph(fn, pool=self.pool)
                if self.pool is None:
                    self.pool = g.pool()
                if kind == "propose":
                    self.propose_graphs[(b, n)] = _Graph(g, None)
                else:
                    self.verify_graphs[(b, n)] = _Graph(g, None)
                seconds.append(time.perf_counter() - t_graph)
        used = (device_memory_held(self.device) - held0) / 2**20
        announce(f"captured {len(self.propose_graphs) + len(self.verify_graphs)} CUDA graphs of the speculative "
                 f"step (requests {_ranges(self.batch_sizes)}: propose x draft slots {self.widths}, and verify x "
                 f"query tokens {self.levels}) "
                 f"in {time.perf_counter() - t0:.1f} s, {used:.0f} MiB ({capture_time_split(seconds)})")

    def release(self) -> int:
        """Free every captured graph (see cuda_graphs.release_graphs)."""
        n = release_graphs(self.propose_graphs) + release_graphs(self.verify_graphs)
        self.pool = None
        return n

    # -- one step ------------------------------------------------------------------------------
    def pick(self, num_requests: int, max_tokens: int, drafting: bool) -> tuple[int, int] | None:
        """(B, Q) of the graph for num_requests requests and at most max_tokens query tokens."""
        if not self.verify_graphs or num_requests > self.batch_sizes[-1]:
            return None
        b = next(x for x in self.batch_sizes if x >= num_requests)
        q = next((x for x in self.levels if (x > 1 or not drafting) and b * x >= max_tokens), None)
        return None if q is None else (b, q)

    @torch.inference_mode()
    def launch(self, key: tuple[int, int], last_tok, start, slots, seeds, temperature, block_tables,
               drafting: bool, budget: int | None, carried=None, first_tokens=None,
               draft_width: int | None = None, extras=None) -> None:
        """Fill the inputs (host arrays of the real requests), replay, and start the copy of the
        results to the host (read_back waits for it). slots: draft slots per request (0 when it
        does not draft). carried: (rows, rows of the previous launch, remaining) for requests whose
        previous step is still in flight (pipelined steps): their last token and its position come
        from that step's carry on the device (last_tok and start hold stale values for them), and
        their draft slots are capped at remaining - 1 - that step's accepted drafts. first_tokens:
        (rows, rows of `tokens`, tokens on the device) for requests whose last token a prefill of
        that step sampled (their positions are the host's). draft_width: the draft slots to run (one
        of self.widths; default k), with every request's slots already capped at it. extras:
        graphed_extras.RowExtras of the rows with top-k / top-p, logits rules or logprobs, whose part
        of the step is redone right after the verify replay (their logprobs come back with read_back;
        a ruled row's drafts are copied to the host after the propose replay, for its rule)."""
        if len(self._launched) == 2:
            raise RuntimeError("a graphed step was launched while two launched ones were not read back: "
                               "their pinned mirrors may still be in flight")
        b, q = key
        n, width = len(last_tok), max(len(row) for row in block_tables)
        if width > self.width:
            raise ValueError(f"a block table of {width} blocks exceeds the captured width {self.width}")
        m = self.mirrors[self._next_mirror]
        self._next_mirror ^= 1
        m.copied.wait()  # the launch before last used these mirrors
        h = m.inputs.numpy()
        h[:, n:b] = 0
        h[0, :n], h[1, :n], h[2, :n], h[4, :n] = last_tok, start, slots, seeds
        h[3, :n] = 1 + np.asarray(slots) if drafting and not self.adaptive else 1
        m.budget.fill_(int(budget or 0))
        bt = m.bt.numpy()
        # the whole captured width: a draft block may reach past a request's table (requests that
        # draft nothing still run the propose graph), and must land in the scratch block there
        bt[:b] = self.engine.scratch_block
        for r, row in enumerate(block_tables):
            bt[r, : len(row)] = row
        temp = m.temp.numpy()
        temp[:n], temp[n:b] = temperature, 0.0
        self.inputs[:, :b].copy_(m.inputs[:, :b], non_blocking=True)
        self.budget.copy_(m.budget, non_blocking=True)
        self.block_tables[:b].copy_(m.bt[:b], non_blocking=True)
        self.temperature[:b].copy_(m.temp[:b], non_blocking=True)
        if carried is not None and len(carried[0]):
            self._take_carry(m, *carried)
        if first_tokens is not None and len(first_tokens[0]):
            self._take_first_tokens(m, *first_tokens)
        m.copied.record()
        drafts = None
        if drafting:
            self.propose_graphs[(b, self.k if draft_width is None else draft_width)].replay()
            if extras is not None and extras.ruled is not None:  # their histories need the drafts on the host
                drafts = graphed_extras.DraftsOnHost(self, extras)
        self.verify_graphs[key].replay()
        logprobs = None
        if extras is not None:
            on_device = graphed_extras.fix_up(self, b, key[1], extras, drafts)
            if on_device is not None:  # copied out beside the read back, waited for with it
                pin = self.device.type == "cuda"
                logprobs = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in on_device)
                for host, dev_t in zip(logprobs, on_device):
                    host.copy_(dev_t, non_blocking=True)
        m.readback[:n].copy_(self.readback[:n], non_blocking=True)
        m.read.record()
        self._launched.append((n, m, logprobs))

    def _take_carry(self, m: "_SpecMirrors", rows, prev_rows, remaining) -> None:
        """The carried rows' inputs from the previous launch's carry (still on the device: nothing
        wrote it since that step's verify graph)."""
        c = len(rows)
        hc = m.carried.numpy()
        hc[0, :c], hc[1, :c], hc[2, :c] = rows, prev_rows, remaining
        dev_c = self.carried[:, :c]
        dev_c.copy_(m.carried[:, :c], non_blocking=True)
        rows_d, prev_d, remaining_d = dev_c.unbind(0)
        src = self.carry.index_select(0, prev_d)
        self.last_tok.index_copy_(0, rows_d, src[:, 0])
        self.start.index_copy_(0, rows_d, src[:, 1])
        cap = torch.minimum(self.slots.index_select(0, rows_d), remaining_d - 1 - src[:, 2]).clamp_min(0)
        self.slots.index_copy_(0, rows_d, cap)

    def _take_first_tokens(self, m: "_SpecMirrors", rows, src, tokens: torch.Tensor) -> None:
        """The last token of requests whose prefill the previous launch's step finished: row
        src of that step's sampled tokens, still on the device (their positions are the host's)."""
        c = len(rows)
        hf = m.first.numpy()
        hf[0, :c], hf[1, :c] = rows, src
        dev_f = self.first_rows[:, :c]
        dev_f.copy_(m.first[:, :c], non_blocking=True)
        self.last_tok.index_copy_(0, dev_f[0], tokens.index_select(0, dev_f[1]).to(self.last_tok.dtype))

    def read_back(self) -> tuple[np.ndarray, tuple | None]:
        """Wait for the oldest launched step's results (its one device-to-host sync; work queued
        after that launch does not delay it). -> (int64 [R, 2k + 3]: k + 1 output tokens (-1
        padding), accepted drafts, query count, k confidences as float32 bits; the logprobs of its
        extras rows, graphed_extras.fix_up's three arrays, or None)."""
        if not self._launched:
            raise RuntimeError("read_back without a launched graphed step")
        n, m, logprobs = self._launched.pop(0)
        self.num_read_backs += 1
        m.read.wait()
        # the pinned mirror is rewritten by a later launch; the logprobs' buffers are this launch's own
        return m.readback[:n].numpy().copy(), logprobs

    @torch.inference_mode()
    def time_draft(self, num_requests: int, table: list[int], context_len: int, width: int | None = None) -> None:
        """Profiler: a propose replay for num_requests dummy requests at context_len, drafting
        `width` slots (one of self.widths; default k, the full draft)."""
        b = next(x for x in self.batch_sizes if x >= num_requests)
        w = self.k if width is None else width
        self._fill_dummy(b, table, context_len, w)
        self.propose_graphs[(b, w)].replay()

    @torch.inference_mode()
    def time_verify(self, num_tokens: int, table: list[int], context_len: int) -> None:
        """Profiler: the verify replay that a step of num_tokens query tokens in requests of up to
        k + 1 tokens runs (the accept part included, as a real step has it)."""
        n_req = -(-num_tokens // (self.k + 1))
        key = self.pick(n_req, num_tokens, drafting=num_tokens > n_req)
        if key is None:
            raise ValueError(f"no captured graph covers {num_tokens} tokens")
        self._fill_dummy(key[0], table, context_len, self.k)
        nq = [min(self.k + 1, num_tokens - r * (self.k + 1)) for r in range(n_req)] + [0] * (key[0] - n_req)
        self.nq[: key[0]].copy_(torch.tensor(nq, dtype=torch.int64))
        self.verify_graphs[key].replay()

    def time_verify_graph(self, rows: int, q: int, table: list[int], context_len: int) -> None:
        """Profiler: the verify graph of `rows` requests (a captured batch size) verifying q - 1
        drafts each (q: one of self.levels), every request at context_len."""
        key = (rows, q)
        if key not in self.verify_graphs:
            raise ValueError(f"no captured verify graph of {rows} requests x {q} query tokens")
        self._fill_dummy(rows, table, context_len, q - 1)
        self.nq[:rows].fill_(q)
        self.verify_graphs[key].replay()

    def _fill_dummy(self, b: int, table: list[int], context_len: int, slots: int) -> None:
        self.block_tables[:b].fill_(self.engine.scratch_block)
        self.block_tables[:b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.start[:b] = context_len
        self.last_tok[:b] = 1
        self.slots[:b] = slots
        self.budget.fill_(b * slots)
        self.temperature[:b] = 1.0


class _Mark:
    """An event on the current stream, waited on by the host (nothing to wait for off CUDA)."""

    def __init__(self, cuda: bool):
        self.event = torch.cuda.Event() if cuda else None

    def record(self) -> None:
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class _SpecMirrors:
    """One set of pinned host buffers for a launch's inputs and its read back, with a mark after
    the copies into the device (copied) and one after the copy out of it (read)."""

    def __init__(self, bmax: int, k: int, width: int, device: torch.device):
        pin = dict(pin_memory=device.type == "cuda")
        self.inputs = torch.zeros(5, bmax, dtype=torch.int64, **pin)
        self.budget = torch.zeros((), dtype=torch.int64, **pin)
        self.bt = torch.zeros(bmax, width, dtype=torch.int32, **pin)
        self.temp = torch.zeros(bmax, dtype=torch.float32, **pin)
        self.carried = torch.zeros(3, bmax, dtype=torch.int64, **pin)  # rows, previous rows, remaining
        self.first = torch.zeros(2, bmax, dtype=torch.int64, **pin)  # rows, rows of the sampled prefill tokens
        self.readback = torch.zeros(bmax, 2 * k + 3, dtype=torch.int64, **pin)
        self.copied, self.read = _Mark(device.type == "cuda"), _Mark(device.type == "cuda")


class GraphPaddedCost(WrappedCost):
    """The cost tables as the graphed step pays them: a step of T query tokens over R requests
    runs the graph (B, Q) that pick() chooses, so it costs what that graph was timed at
    (CostModel.verify_graph: B rows of Q tokens) or, where the tables hold no such timing,
    verify_ms(B*Q) of its token rows. Steps the graphs do not cover (more requests than captured)
    cost verify_ms(T)."""

    MEMO_SIZE = 256  # answers kept; a steady load asks for one or two shapes, each up to R * k + 1 prices

    def __init__(self, cost, graphed: "GraphedSpecStep"):
        super().__init__(cost)
        self.graphed = graphed
        self._memo: dict[tuple, np.ndarray] = {}

    def verify_ms_for(self, num_requests: int, tokens: np.ndarray) -> np.ndarray:
        """verify_ms of the padded row counts, vectorized (the policy asks for every B at once).
        Remembered by (requests, tokens, whether graphs are held): the tables and the graphs'
        shapes never change, and the policy asks the same question every step of a steady load
        (at one request, profiled on the CPU, the padding and the lookups were ~a sixth of its host
        time a step; on an H100 at one request that host time was hidden: no change, run 67). The
        answer is read-only: callers add to it, never into it."""
        tokens = np.atleast_1d(np.asarray(tokens, dtype=np.int64))
        key = (num_requests, bool(self.graphed.verify_graphs), tokens.shape, tokens.tobytes())
        ms = self._memo.get(key)
        if ms is None:
            b, levels, covered = self._graphs_for(num_requests, tokens)
            ms = np.asarray(self.cost.verify_ms(np.where(covered, b * levels, tokens)), dtype=np.float64)
            ms = ms.reshape(tokens.shape).copy()
            timed = getattr(self.cost, "verify_graph_ms", None)
            if timed is not None and b:
                for q in np.unique(levels[covered]):  # the graphs timed one by one, where the tables hold them
                    graph_ms = timed(b, int(q))
                    if graph_ms is not None:
                        ms[covered & (levels == q)] = graph_ms
            ms.setflags(write=False)
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = ms
        return ms

    def padded(self, num_requests: int, tokens: np.ndarray) -> np.ndarray:
        """The token rows the graph that pick() chooses runs (tokens itself where no graph covers)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        b, levels, covered = self._graphs_for(num_requests, tokens)
        return np.where(covered, b * levels, tokens)

    def _graphs_for(self, num_requests: int, tokens: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """(B: the graphs' rows for num_requests, 0 when none covers them; per entry of tokens the
        query level Q of the graph pick() chooses; whether a graph covers that entry at all)."""
        g = self.graphed
        if not g.verify_graphs or num_requests > g.batch_sizes[-1]:
            return 0, np.zeros(tokens.shape, dtype=np.int64), np.zeros(tokens.shape, dtype=bool)
        b = next(x for x in g.batch_sizes if x >= num_requests)
        levels = np.asarray(g.levels, dtype=np.int64)
        # the smallest level whose b*q holds the tokens; steps with drafts skip the q = 1 level
        idx = np.searchsorted(b * levels, tokens, side="left")
        idx = np.where((tokens > num_requests) & (levels[np.minimum(idx, len(levels) - 1)] == 1), idx + 1, idx)
        return b, levels[np.minimum(idx, len(levels) - 1)], idx < len(levels)
