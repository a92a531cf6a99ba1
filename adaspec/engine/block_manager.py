"""Fixed-size KV blocks: a free list and per-request block tables."""
from __future__ import annotations

from adaspec.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # pop() from the end; reversed so block 0 is handed out first (easier to read in tests)
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that positions [0, num_tokens) have a slot."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        if not self.try_grow(seq, num_tokens):
            raise RuntimeError("out of KV blocks; call can_grow first")

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """grow when the free blocks suffice (-> True), else change nothing (-> False)."""
        n = self.blocks_needed(seq, num_tokens)
        if n > len(self._free):
            return False
        for _ in range(n):
            seq.block_table.append(self._free.pop())
        return True

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back blocks wholly beyond position num_tokens (after a rejected speculation)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_table))
        seq.block_table = []
