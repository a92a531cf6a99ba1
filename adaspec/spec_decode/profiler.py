"""Startup profiling for the adaptive policy: time dummy verify and draft steps, cache the tables.

Dummy steps use real shapes: verify(n) runs n query tokens as ceil(n / (k+1)) requests of up
to k+1 tokens each, every one over `profile_context_len` tokens of context; draft(R) proposes
blocks for R requests at that context length. All dummy requests alias the same KV blocks
(the cache holds no real request yet, and aliasing does not change the work done).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from adaspec.announce import announce
from adaspec.engine.runner import ForwardItem
from adaspec.models.fused import kv_write_in_use
from adaspec.sample import kernels
from adaspec.sample.probs import processed_probs
from adaspec.spec_decode.cost_model import (
    CostModel, cache_path, default_cache_key, draft_grid, graph_rows_grid, load_or_profile, profile, verify_grid,
)

log = logging.getLogger("adaspec.profile")


# Bump when a change to the engine's step changes what a step costs (the cached tables would then
# price a step the engine no longer runs). 2: CUDA graphs, fused projections and pointwise ops,
# the Triton paged kernel, pinned host-to-device copies. 3: the speculative step's own graphs
# (propose; verify with accept; query-length levels). 4: the adaptive step's verify graphs at every
# query length (a table entry now times the graph that length picks), and drafts of k < block_size
# slots run k slots' heads only. 5: the shapes' runs in rounds over the table (cost_model._time_table).
# 6: the verify graphs timed one by one (CostModel.verify_graph), as the graphed step is priced.
STEP_REVISION = 6


# the server log's line that carries the cost tables as JSON (replay_policy.py reads it)
TABLES_JSON_PREFIX = "cost tables (json): "


def default_cache_dir() -> Path:
    return Path(os.environ.get("ADASPEC_CACHE_DIR", Path.home() / ".cache" / "adaspec")) / "cost_models"


class _DummySeq:
    """What SpeculativeDecoder.propose reads from a request (no logits rule: sample/logits_rules.py)."""

    def __init__(self, request_id, params):
        self.request_id, self.params, self.seed = request_id, params, 0
        self.logits_rule = None


def _dummy_context(engine, decoder) -> tuple[int, list[int]]:
    """(context length, block table) of every dummy request: profile_context_len tokens (what
    max_model_len allows), over blocks that all requests alias."""
    k = decoder.num_spec_tokens
    ctx = max(1, min(decoder.cfg.profile_context_len, engine.max_model_len - decoder.block - 2))
    n_blocks = -(-(ctx + max(k + 1, decoder.block)) // engine.config.block_size)
    return ctx, [i % engine.num_blocks for i in range(n_blocks)]


def _dummy_steps(engine, decoder):
    from adaspec.sampling_params import SamplingParams

    k = decoder.num_spec_tokens
    ctx, table = _dummy_context(engine, decoder)
    params = SamplingParams(temperature=1.0, max_tokens=16)

    g = decoder.graphed
    if g is not None:  # price what the step runs: the graphs (their accept part included)
        return (lambda n: g.time_verify(n, table, ctx)), (lambda n: g.time_draft(n, table, ctx)), \
            (lambda n, w: g.time_draft(n, table, ctx, width=w)), ctx

    def verify(n_tokens: int) -> None:
        items, left = [], n_tokens
        while left > 0:
            q = min(k + 1, left)
            items.append(ForwardItem([1] * q, ctx, table, q))
            left -= q
        res = engine.runner.execute(items, decoder.capture_layers)
        ones = torch.ones(res.logits.shape[0], device=engine.device)  # T = 1 processing, as verification does
        processed_probs(res.logits, ones, ones, ones.long() * 0, any_filter=False, any_greedy=False)

    def draft(n_requests: int, width: int | None = None) -> None:
        seqs = [_DummySeq(f"profile-{i}", params) for i in range(n_requests)]
        decoder.propose(seqs, [1] * n_requests, [ctx] * n_requests, [table] * n_requests, width=width)

    return verify, draft, draft, ctx


def verify_graph_shapes(decoder) -> tuple[object, list[tuple[int, int]]]:
    """(fn(rows, q) replaying that verify graph over dummy requests, the (rows, q) to time): every
    query level at the batch sizes of graph_rows_grid (the rest interpolated), or (None, []) when
    the step runs no verify graphs (eager, CPU): the token table then prices every step."""
    g = decoder.graphed
    if g is None or not g.verify_graphs:
        return None, []
    ctx, table = _dummy_context(g.engine, decoder)
    rows = graph_rows_grid(g.batch_sizes)
    shapes = [(b, q) for b in rows for q in g.levels if (b, q) in g.verify_graphs]
    return (lambda b, q: g.time_verify_graph(b, q, table, ctx)), shapes


def build_cost_model(engine, decoder, drafter_path: str, cache: bool = True) -> CostModel:
    cfg = engine.config
    k = decoder.num_spec_tokens
    verify_fn, draft_fn, draft_width_fn, ctx = _dummy_steps(engine, decoder)
    graph_fn, graph_shapes = verify_graph_shapes(decoder)
    # adaptive_draft_width "budget": the narrower drafts get tables of their own
    narrow = [w for w in decoder.draft_widths if w < k]
    max_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (k + 1))
    device_name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    key = default_cache_key(
        model=str(Path(str(engine.config.model)).expanduser()), drafter=drafter_path, dtype=str(engine.dtype),
        device=device_name, threads=torch.get_num_threads(), max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size, k=k, context_len=ctx,
        attention=engine.attention_backend, torch=torch.__version__, repeats=decoder.cfg.profile_repeats,
        cuda_graphs=engine.use_cuda_graphs, step_revision=STEP_REVISION,
        tensor_parallel_size=cfg.tensor_parallel_size, draft_widths=narrow,
        # the sampler's and the Markov loop's implementation change what a step costs: tables
        # timed with the Triton kernels must not price a run with the torch ops, or the reverse
        sampler=kernels.in_use(engine.device), markov_loop=kernels.markov_loop_in_use(engine.device),
        # (so do the fused cache writes: absent from the key when not in use, as on the CPU, so the
        # tables cached before the key had them stay valid there)
        **({"kv_write": kv} if (kv := kv_write_in_use(engine.device)) != "index_copy" else {}),
    )
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
    cache_dir = Path(decoder.cfg.cost_model_cache_dir) if decoder.cfg.cost_model_cache_dir else default_cache_dir()
    where = f" (cached at {cache_path(cache_dir, key)} afterwards)" if cache else ""
    profiled = []

    def run_profile() -> CostModel:
        vgrid, dgrid, repeats = verify_grid(max_tokens), draft_grid(cfg.max_num_seqs), decoder.cfg.profile_repeats
        shapes = len(vgrid) + len(dgrid) * (1 + len(narrow)) + len(graph_shapes)
        announce(f"profiling the adaptive policy's cost tables: {shapes} shapes x {repeats} runs"
                 + (f" (drafts of {', '.join(map(str, narrow))} and {k} slots)" if narrow else "")
                 + (f" ({len(graph_shapes)} of them verify graphs)" if graph_shapes else "") + where)
        warmup = 1
        with progress_bar(shapes * (repeats + warmup), "cost tables") as bar:
            def counted(fn):
                def run(*shape: int) -> None:
                    fn(*shape)
                    bar.update(1)
                return run

            with torch.inference_mode():
                model = profile(counted(verify_fn), counted(draft_fn), vgrid, dgrid, repeats=repeats, warmup=warmup,
                                sync=sync, fn_draft_width=counted(draft_width_fn) if narrow else None,
                                narrow_widths=narrow, fn_verify_graph=counted(graph_fn) if graph_shapes else None,
                                graph_shapes=graph_shapes)
        profiled.append(True)
        return model

    if not cache:
        return run_profile()
    model = load_or_profile(cache_dir, key, run_profile)
    if not profiled:
        announce(f"read cached cost tables from {cache_path(cache_dir, key)}")
    # into the server's log (silent offline): what the policy prices, beside what the served steps
    # cost (/metrics spec_decode_cost_check_*), for a run whose cache is gone with its machine
    log.info("cost tables: %s", describe_tables(model))
    # the same as JSON (CostModel.to_dict), for benchmarks/replay_policy.py --server-log
    log.info("%s%s", TABLES_JSON_PREFIX, json.dumps(model.to_dict()))
    return model


def describe_tables(model: CostModel) -> str:
    """The tables in one line: verify ms by tokens, draft ms by requests (and by width)."""
    def fmt(t):
        return "{" + ", ".join(f"{int(n)}: {ms:.3f}" for n, ms in zip(t.sizes, t.ms)) + "}"

    parts = [f"verify ms by tokens {fmt(model.verify)}", f"draft ms by requests {fmt(model.draft)}"]
    parts += [f"draft of {w} slots ms by requests {fmt(t)}" for w, t in sorted(model.draft_narrow.items())]
    parts += [f"verify graph of {q} tokens a request ms by requests {fmt(t)}" for q, t in sorted(model.verify_graph.items())]
    return "; ".join(parts)


def progress_bar(total: int, desc: str):
    """tqdm on stderr when it is a terminal; otherwise a no-op (announce() said it already)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False,
                disable=not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()))
