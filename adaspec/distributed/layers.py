"""The modules that carry tensor parallelism's collectives. Each replaces a plain module of the
model after its weights are sliced (sharding.py), so the model code itself calls them as before
(`self.o_proj(x)`, `self.mlp.down_proj(x)`, `embed_tokens(ids)`, `lm_head(h)`).

Column-parallel projections (q/k/v, gate/up) need no collective: they stay nn.Linear with fewer
output rows. The collectives sit after the row-parallel projections (o_proj, down_proj), in the
embedding and in the LM head. Empty inputs skip them: every rank runs the same shapes, so all
ranks skip together."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if x.numel():
        dist.all_reduce(x, group=group)
    return x


def all_gather_last_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """[..., n] on every rank -> [..., size * n], rank r's columns at [r*n, (r+1)*n)."""
    x = x.contiguous()
    out = x.new_empty((size, *x.shape))
    if x.numel():
        if dist.get_backend(group) == "nccl":  # one kernel, CUDA-graph capturable
            dist.all_gather_into_tensor(out, x, group=group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=group)
    return out.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input's features are split across ranks
    (the heads of o_proj, the intermediate features of down_proj). The bias is added once,
    after the reduction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias) if bias is not None else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [start, start + num_valid) of the table, padded with zero rows to the
    common shard size (so that the LM head can share the weight and gather equal pieces). Ids
    outside the shard look up zeros; the all-reduce sums one real row with zeros, exactly."""

    def __init__(self, weight: torch.Tensor, start: int, num_valid: int, group):
        super().__init__()
        self.weight = _param(weight)
        self.start, self.num_valid, self.group = start, num_valid, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0), self.group)


class ParallelLMHead(nn.Module):
    """Logits of the rank's vocabulary shard, gathered so that every rank holds the full row
    (sampling and the drafter's Markov loop then run identically everywhere)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group, size: int):
        super().__init__()
        self.weight = _param(weight)
        self.vocab_size, self.group, self.size = vocab_size, group, size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(h, self.weight), self.group, self.size)
        if logits.shape[-1] != self.vocab_size:  # the last shard's padding rows
            logits = logits[..., : self.vocab_size].contiguous()
        return logits
