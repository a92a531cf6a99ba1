"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): each prompt token's log-probability
given the tokens before it (the first has none: None), with the prompt's top-n at that position,
from the prefill's own forward. A chunk of such a request asks the runner for the logits of all
its query rows (ForwardItem.num_logits), not only the last; its sampling row, when it ends the
prompt, is still the last. Raw model logprobs (before temperature or logits rules), as vLLM's
default logprobs mode reports them; the prompt token's rank is exact.

Entries are appended in prompt order; a request preempted and recomputed runs the same chunks
again, and positions that already have an entry are skipped.

Cost: such a chunk's logits are computed for all its rows at once (the runner's LM head: a
4,096-token chunk of a 152k vocabulary is ~3.7 GB of transient bf16 + float32 on a GPU, not
measured), and a step holding one runs eagerly (the runner's graphs serve rows that want one
logits row, or verification shapes).
"""
from __future__ import annotations

from itertools import accumulate

import torch

from adaspec.h2d import to_device, to_device_many

# rows of log-softmax computed at a time (a long prompt chunk of a 151k vocabulary would take
# gigabytes at once)
CHUNK_ELEMENTS = 1 << 24


def prompt_rows(seq, nc: int, n: int) -> int:
    """How many of the first rows of a chunk of n query rows from position nc predict prompt
    tokens (row j predicts the token at nc + j + 1) whose logprob the request still lacks."""
    done = seq.prompt_logprobs
    P = len(seq.prompt_token_ids)
    if done is None or len(done) >= P:
        return 0
    return max(0, min(nc + n, P - 1) - nc)


def logits_rows(seq, nc: int, n: int, samples: bool) -> int:
    """ForwardItem.num_logits for the chunk: all n rows where some predict prompt tokens to
    record (the trailing rows then cover them), else 1 for a sampling row, else 0."""
    if seq.prompt_logprobs is not None and prompt_rows(seq, nc, n):
        return n
    return int(samples)


def record(logits: torch.Tensor, chunks: list[tuple]) -> None:
    """chunks: (seq, nc, n, first logits row) of the chunks (n query rows from position nc) that
    asked for their rows' logits; each
    request's next prompt positions get their entries. Reads the results back (a device sync: only
    steps with such chunks pay it)."""
    rows, targets, owners = [], [], []
    for seq, nc, n, start in chunks:
        for j in range(prompt_rows(seq, nc, n)):
            p = nc + j + 1
            rows.append(start + j)
            targets.append(seq.prompt_token_ids[p])
            owners.append((seq, p))
    if not rows:
        return
    top_n = max(seq.params.prompt_logprobs for seq, _ in owners)
    V, dev, N = logits.shape[-1], logits.device, len(rows)
    step = max(1, CHUNK_ELEMENTS // V)
    # one upload, the chunks written into whole outputs, one read-back of each: per chunk, that
    # was two uploads and four syncs (38 chunks of a 4,096-token prefill at a 152k vocabulary)
    rows_t, targets_t = to_device_many([rows, targets], dev)
    chosen_t = torch.empty(N, dtype=torch.float32, device=dev)
    ranks_t = torch.empty(N, dtype=torch.int64, device=dev)
    top_lps_t = torch.empty(N, top_n, dtype=torch.float32, device=dev)
    top_ids_t = torch.empty(N, top_n, dtype=torch.int64, device=dev)
    for c in range(0, N, step):
        lp = torch.log_softmax(logits[rows_t[c:c + step]].float(), dim=-1)
        c_lp = lp.gather(-1, targets_t[c:c + step].unsqueeze(-1))
        chosen_t[c:c + step] = c_lp.squeeze(-1)
        ranks_t[c:c + step] = (lp > c_lp).sum(-1) + 1
        if top_n:
            top_lps_t[c:c + step], top_ids_t[c:c + step] = lp.topk(top_n, dim=-1)
    chosen, ranks = chosen_t.tolist(), ranks_t.tolist()
    top_ids, top_lps = (top_ids_t.tolist(), top_lps_t.tolist()) if top_n else ([], [])
    for k, ((seq, p), tok) in enumerate(zip(owners, targets)):
        if p != len(seq.prompt_logprobs):  # already recorded (a recomputation) or out of order
            continue
        w = seq.params.prompt_logprobs
        entry = dict(zip(top_ids[k][:w], top_lps[k][:w])) if w else {}
        entry[tok] = chosen[k]
        seq.prompt_logprobs.append(entry)
        seq.prompt_logprob_ranks.append(ranks[k])


def sampling_logits(logits: torch.Tensor, items, chunks: list[tuple], sample_items: list[int]) -> torch.Tensor:
    """For a forward of `items` (ForwardItem) in which some chunks asked for every row's logits:
    record their prompt logprobs (chunks: (seq, nc, n, index into items), before the rows'
    num_computed_tokens move) and return the sampling rows only, the last row of each of
    sample_items (indices into items). Shared by the plain step and the pipelined prefill launch."""
    ends = list(accumulate(it.num_logits for it in items))
    record(logits, [(seq, nc, n, ends[i] - items[i].num_logits) for seq, nc, n, i in chunks])
    return logits[to_device([ends[i] - 1 for i in sample_items], logits.device, torch.int64)]
