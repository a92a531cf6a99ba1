"""Where drafter training sequences come from: a packed corpus token stream, or a file of
sequences (self-distilled continuations, .npy [N, L] of token ids)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from adaspec.errors import AdaspecError


class _Resumable:
    gen: torch.Generator

    def get_state(self):
        return self.gen.get_state()

    def set_state(self, state) -> None:
        self.gen.set_state(state)


class RowSampler(_Resumable):
    """Random rows of an [N, L] token array, cropped to a random window of seq_len tokens."""

    def __init__(self, rows: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        if rows.ndim != 2:
            raise AdaspecError(f"sequence file must hold a 2-D [N, L] array, got shape {rows.shape}")
        self.rows = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        self.seq_len = min(seq_len, self.rows.shape[1])
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        N, L = self.rows.shape
        r = torch.randint(0, N, (self.batch_size,), generator=self.gen)
        s = torch.randint(0, L - self.seq_len + 1, (self.batch_size,), generator=self.gen)
        self.last_draw = (r, s)  # which rows and windows (train/feature_cache.py reads their features)
        idx = s[:, None] + torch.arange(self.seq_len)[None, :]
        return self.rows[r[:, None], idx]


class StreamSampler(_Resumable):
    """Random windows of a packed stream (documents joined by EOS)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0):
        if tokens.size < seq_len + 1:
            raise AdaspecError(f"{tokens.size} training tokens, fewer than --seq-len {seq_len}")
        self.tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        s = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=self.gen)
        return self.tokens[s[:, None] + torch.arange(self.seq_len)[None, :]]


class MixedSampler:
    """Rows of several samplers stacked into one batch (e.g. self-distilled + corpus text)."""

    def __init__(self, *parts):
        self.parts = parts

    def next(self) -> torch.Tensor:
        return torch.cat([p.next() for p in self.parts])

    def get_state(self):
        return [p.get_state() for p in self.parts]

    def set_state(self, states) -> None:
        for p, s in zip(self.parts, states):
            p.set_state(s)


def corpus_tokens(corpus: Path, tokenizer_dir: Path, split: str = "train") -> np.ndarray:
    """The split's packed token stream: CORPUS/tokens/{split}.npy, or tokenized via the train
    helper's cache (which checks the tokenizer)."""
    from adaspec.train.data import load_tokens

    return load_tokens(Path(corpus), Path(tokenizer_dir), splits=(split,))[split]


def load_sequences(path: Path) -> np.ndarray:
    path = Path(path)
    if not path.is_file():
        raise AdaspecError(f"--data file not found: {path}")
    if path.suffix != ".npy":
        raise AdaspecError(f"--data must be a .npy array of token ids [N, L] (got {path.name})")
    return np.load(path)


def prompt_windows(tokens: np.ndarray, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """n random windows of `length` tokens of a stream, as self-distillation prompts."""
    g = torch.Generator().manual_seed(seed)
    t = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    s = torch.randint(0, t.numel() - length, (n,), generator=g)
    return t[s[:, None] + torch.arange(length)[None, :]]
