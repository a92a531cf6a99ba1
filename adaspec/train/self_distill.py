"""Continuations sampled from the target itself, for drafter training and offline evaluation.

A plain batched decode loop over the target's own paged forward (one contiguous run of cache
blocks per row; prompts of different lengths share a batch, as in the engine), so the
samples are exactly the target's distribution and cost one token per row per step. Attention
runs on the engine's backend for the device ("auto": the Triton paged kernel on CUDA, which reads
the cache in place; H200 run 28 profiled the "reference" backend's gather of every row's keys at
24 of a decode step's 58 ms of kernels at 768 rows; if that kernel fails, the batch is decoded
again on the reference attention, with a warning, rather than losing the build), plain torch on
the CPU. No stop
at EOS: fixed-length continuations keep batching trivial, and after an EOS the target
simply starts a new document, which is still its own text.

On CUDA with the Triton kernel, a batch's decode steps replay one CUDA graph of the forward
(engine/cuda_graphs.GraphedForward, captured for the batch's B rows and one query token each;
the prompts' prefill stays eager and ragged): eagerly, a step of the code-0.6b target at 1,024
rows took 37.2 ms of wall time for 14.5 ms of kernels (H100 run 51's build, the step profile in
its self-distillation manifest): the host's launches, not the GPU, set the pace of the build's
self-distillation, evaluation and calibration. A capture that fails costs the speed, not the
build: the batch then decodes eagerly, with a warning.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from adaspec.announce import announce
from adaspec.h2d import to_device
from adaspec.models.attention import build_attention_metadata


@torch.no_grad()
def sample_continuations(target, prompts: torch.Tensor, gen_len: int, temperature: float = 1.0, top_p: float = 1.0,
                         seed: int = 0, batch_size: int = 256, progress: bool = False, profile=None) -> torch.Tensor:
    """prompts [N, P] -> [N, P + gen_len] (prompt then continuation). profile: a
    train/step_profile.StepProfile over the decode steps (of the first batch)."""
    rows = sample_ragged(target, prompts.tolist(), gen_len, temperature, top_p, seed, batch_size, progress, profile)
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def sample_ragged(target, prompts: list[list[int]], gen_len: int, temperature: float = 1.0, top_p: float = 1.0,
                  seed: int = 0, batch_size: int = 256, progress: bool = False, profile=None,
                  attention_backend: str = "auto", cuda_graphs: bool | str = True) -> list[list[int]]:
    """Prompts of any lengths -> each prompt followed by gen_len sampled tokens. attention_backend:
    as the engine's --attention-backend ("auto", "triton", "varlen", "reference"). cuda_graphs:
    replay the decode steps as a CUDA graph where the device and backend allow it (CUDA, the
    Triton kernel); "eager": run the graph's forward eagerly over its static buffers, on any device
    (the Triton kernel's contract in plain torch: tests of the buffer logic); False: the eager loop."""
    from adaspec.engine.llm_engine import choose_attention_backend

    device = next(target.parameters()).device
    backend = choose_attention_backend(attention_backend, device, next(target.parameters()).dtype)
    if cuda_graphs not in (True, False, "eager"):
        raise ValueError(f"cuda_graphs must be True, False or 'eager', not {cuda_graphs!r}")
    rng = torch.Generator(device=device).manual_seed(seed)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="sample", unit="seq")
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        graphs = _graph_mode(cuda_graphs, backend, device)
        try:
            out.extend(_sample_batch(target, batch, gen_len, temperature, top_p, rng, profile, backend, graphs=graphs))
        except Exception as e:  # noqa: BLE001 - "auto" chose a kernel that failed: never lose a build to it
            if attention_backend != "auto" or backend == "reference":
                raise
            print(f"self-distillation: the {backend} attention failed ({type(e).__name__}: {e}); "
                  "decoding on the reference attention from here", file=sys.stderr, flush=True)
            backend = "reference"
            out.extend(_sample_batch(target, batch, gen_len, temperature, top_p, rng, profile, backend))
        if bar:
            bar.update(min(batch_size, len(prompts) - i))
    if bar:
        bar.close()
    return out


def _graph_mode(cuda_graphs: bool | str, backend: str, device: torch.device) -> str | None:
    """How a batch's decode steps run: "cuda" (captured), "eager" (the graph's forward over its
    static buffers, run eagerly), or None (the eager loop)."""
    if cuda_graphs == "eager":
        return "eager"
    return "cuda" if cuda_graphs and device.type == "cuda" and backend == "triton" else None


def _decode_graph(target, caches, tables: list[list[int]], scratch_block: int, block_size: int, max_len: int,
                  mode: str):
    """The batch's decode forward (len(tables) rows of one query token) as a captured graph, or
    None where the capture failed (the batch then decodes eagerly: a slower build, not a lost one).
    mode "eager": nothing captured, the same forward over the same buffers with the Triton
    kernel's contract in plain torch ("paged_torch", which reads the cache that any backend wrote)."""
    from adaspec.engine.cuda_graphs import GraphedForward

    B = len(tables)
    graphs = GraphedForward(target, caches, block_size, next(target.parameters()).device, B, query_lens=(1,),
                            max_model_len=max_len, max_blocks_per_seq=len(tables[0]), scratch_block=scratch_block,
                            capture_layers=None, batch_sizes=[B], backend="triton" if mode == "cuda" else "paged_torch")
    stream = torch.cuda.current_stream() if mode == "cuda" else None
    try:
        graphs.capture(eager=mode == "eager")
    except (RuntimeError, torch.OutOfMemoryError) as e:
        if stream is not None:  # an invalidated capture's end raises before torch.cuda.graph restores the stream
            torch.cuda.set_stream(stream)
        graphs.release()
        announce(f"WARNING: capturing the decode graph of {B} rows failed ({type(e).__name__}: {str(e)[:200]}); "
                 "this batch decodes eagerly")
        return None
    return graphs


def _sample_batch(target, prompts: list[list[int]], gen_len, temperature, top_p, rng, profile=None,
                  backend: str = "reference", graphs: str | None = None) -> list[list[int]]:
    from adaspec.sample.probs import processed_probs

    cfg = target.config
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    B, bs = len(prompts), 16
    lens = np.array([len(p) for p in prompts])
    nblk = int((lens.max() + gen_len + bs - 1) // bs)
    tables = [list(range(b * nblk, (b + 1) * nblk)) for b in range(B)]
    scratch = B * nblk  # one block no row owns: the graph's capture writes its dummy keys there
    caches = [
        (torch.zeros((scratch + 1) * bs, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype),
         torch.zeros((scratch + 1) * bs, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
    decode = None
    rows, no_ids, one_each = np.arange(B), np.zeros(B, dtype=np.int64), np.ones(B, dtype=np.int64)
    table_array = np.asarray(tables, dtype=np.int64)  # (GraphedForward copies a 2-D array without a loop per row)
    # prefill: every prompt at once (ragged), then one token per row per step
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(device)
    q_lens, kv_lens = lens.tolist(), lens.copy()
    last = torch.from_numpy(np.cumsum(lens) - 1).to(device)
    temp = torch.full((B,), float(temperature), device=device)
    tp = torch.full((B,), float(top_p), device=device)
    tk = torch.zeros(B, dtype=torch.long, device=device)
    new = torch.empty(B, gen_len, dtype=torch.long, device=device)
    try:
        for t in range(gen_len):
            if t == 1 and graphs is not None:  # after the prefill, whose activations are freed by now
                decode = _decode_graph(target, caches, tables, scratch, bs, nblk * bs, graphs)
            if profile is not None:
                profile.maybe_start(t)
            if t == 0 or decode is None:  # the prompts' ragged prefill, or the eager loop
                meta = build_attention_metadata(backend, tables, q_lens, kv_lens.tolist(), None, bs, device)
                hidden, _ = target(ids, positions, caches, meta)
                logits = target.compute_logits(hidden[last])
            else:  # one replay: the last tokens, still on the device, go in as the graph's inputs
                logits, _, _ = decode.run((B, 1), no_ids, one_each, kv_lens - 1, table_array, fill=(rows, rows, ids))
            if temperature <= 0:
                nxt = logits.argmax(-1)
            else:
                probs = processed_probs(logits, temp, tp, tk, any_filter=top_p < 1.0, any_greedy=False)
                nxt = torch.multinomial(probs, 1, generator=rng).squeeze(-1)
            new[:, t] = nxt
            ids = nxt
            if decode is None:
                # pinned and asynchronous: a pageable copy waits for the stream, so the host (its
                # metadata, its launches) could never run ahead of the GPU and every step paid both
                positions, last = to_device(kv_lens, device), torch.arange(B, device=device)
            q_lens, kv_lens = [1] * B, kv_lens + 1
            if profile is not None:
                profile.maybe_stop(t + 1)
        new = new.tolist()
    finally:  # (also when a kernel failed: sample_ragged then decodes the batch again on another backend)
        if decode is not None:
            decode.release()
    return [list(p) + n for p, n in zip(prompts, new)]
