"""The frozen target's features of the drafter's training rows, computed once and kept on the
device (`adaspec train drafter --cache-target-features`).

A drafter training step runs the frozen target over its whole batch for the features the drafter
reads (the captured layers) and the distributions its loss compares against (the final hidden
state): about a third of a code-0.6b step's kernel time (H200 run 40's step profile: the target's
matmuls and attention ~11-13 of 33 ms). The self-distilled rows repeat: 4,032 rows are seen ~23
times each in 4,000 steps. So their features are computed once, in training-batch-sized chunks
(the compiled target's shape), and each step gathers its rows' from here; the corpus rows of a
mixed batch (--corpus-frac) are fresh windows every step and still run the target.

The rows must be exactly one training window long (the self-distilled rows are: prompt plus
continuation = --seq-len): a window cut from a longer row would see context the cached row's
features do not match. Memory: rows x length x (captured layers + 1) x hidden x the target's
dtype size (12.7 GB for code-0.6b's 4,032 rows in bf16).
"""
from __future__ import annotations

import torch

from adaspec.errors import AdaspecError
from adaspec.h2d import to_device


def cache_bytes(num_rows: int, length: int, hidden: int, num_layers: int, dtype: torch.dtype) -> int:
    """What the cache of num_rows rows holds: the final hidden state and num_layers captured layers."""
    return num_rows * length * hidden * (num_layers + 1) * torch.empty((), dtype=dtype).element_size()


class TargetFeatureCache:
    """hidden [N, L, d] and features [N, L, m*d] of every row, on the target's device."""

    def __init__(self, hidden: torch.Tensor, features: torch.Tensor):
        self.hidden, self.features = hidden, features

    @classmethod
    @torch.no_grad()
    def build(cls, target, rows: torch.Tensor, layer_ids: list[int], amp, batch_size: int) -> "TargetFeatureCache":
        """rows: int64 [N, L] token ids (host). Runs target_features in chunks of batch_size rows."""
        from adaspec.train.drafter_loss import target_features

        device = next(target.parameters()).device
        hidden = features = None
        for i in range(0, rows.shape[0], batch_size):
            chunk = rows[i:i + batch_size]
            n = chunk.shape[0]
            if n < batch_size:  # padded with the first rows: every chunk the compiled target's one shape
                chunk = torch.cat([chunk, rows[torch.arange(batch_size - n) % rows.shape[0]]])
            with amp:
                h, f = target_features(target, chunk.to(device), layer_ids)
            if hidden is None:
                N, L = rows.shape
                hidden = torch.empty(N, L, h.shape[-1], dtype=h.dtype, device=device)
                features = torch.empty(N, L, f.shape[-1], dtype=f.dtype, device=device)
            hidden[i:i + n] = h[:n]
            features[i:i + n] = f[:n]
        if hidden is None:
            raise AdaspecError("--cache-target-features: no rows to cache")
        return cls(hidden, features)

    def rows_on_device(self, rows: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The windows [starts, starts + seq_len) of the given rows (host tensors) -> the rows'
        indices on the device, for take(); starts must be 0 (rows one window long: the module's
        docstring)."""
        if bool((starts != 0).any()) or seq_len != self.hidden.shape[1]:
            raise AdaspecError("--cache-target-features: the cached rows are one window long; a window that "
                               "starts inside a row (rows longer than --seq-len) cannot use them")
        return to_device(rows, self.hidden.device)  # pinned: a pageable copy would wait for the GPU's queue

    def take(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: indices on the device -> (hidden [B, T, d], features [B, T, m*d]). No host read:
        a captured training step (train/captured_step.py) runs it."""
        return self.hidden[rows], self.features[rows]
