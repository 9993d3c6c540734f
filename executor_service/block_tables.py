"""Every held sequence's block table as one row of a host array.

A step's `[num_seqs, width]` block-table tensor is then one gather over row indices instead of
a Python list of lists turned into a tensor (2.5 ms per 256-sequence decode step before)."""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 256) -> None:
        self.width = max_blocks_per_seq
        self.array = np.full((initial_rows, max_blocks_per_seq), -1, dtype=np.int32)
        self.lengths = np.zeros(initial_rows, dtype=np.int64)
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def add(self, block_table: list[int]) -> int:
        """Take a row for a new sequence and write its table; returns the row."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.lengths[row] = 0
        self.extend(row, block_table)
        return row

    def extend(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.lengths[row])
        self.array[row, start : start + len(block_ids)] = block_ids
        self.lengths[row] = start + len(block_ids)

    def free(self, row: int) -> None:
        self.array[row, : self.lengths[row]] = -1
        self.lengths[row] = 0
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width] int32: the first `width` entries of each row (padding -1)."""
        return self.array[rows, :width]

    def _grow(self) -> None:
        old = len(self.array)
        self.array = np.concatenate([self.array, np.full_like(self.array, -1)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
