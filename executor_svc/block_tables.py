"""BlockTables: every held sequence's block table as a row of one persistent numpy array, so a
step gathers its rows in one indexing operation rather than re-reading Python ints. Numpy only.
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, rows: int = 64) -> None:
        self.width = max_blocks_per_seq
        self.array = np.zeros((rows, self.width), dtype=np.int32)  # [rows, width]; see gather
        self.lengths = np.zeros(rows, dtype=np.int64)  # [rows]: blocks held by each row
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: low rows first

    def add(self, block_ids: list[int]) -> int:
        """A row holding `block_ids`; returns its index."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.lengths[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.width:
            raise ValueError(f"a block table of {end} blocks exceeds {self.width} per sequence")
        self.array[row, start:end] = block_ids
        self.lengths[row] = end

    def append_many(self, rows: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """Appends counts[i] ids to rows[i] (distinct rows), taken in turn from block_ids: one
        scatter for the whole step."""
        ends = self.lengths[rows] + counts  # [n]
        if len(ends) and int(ends.max()) > self.width:
            raise ValueError(f"a block table of {int(ends.max())} blocks exceeds {self.width} "
                             "per sequence")
        first = np.cumsum(counts) - counts  # [n]: each row's first id in block_ids
        columns = np.repeat(self.lengths[rows] - first, counts) + np.arange(len(block_ids))
        self.array[np.repeat(rows, counts), columns] = block_ids
        self.lengths[rows] = ends

    def free(self, row: int) -> None:
        self._free.append(row)

    def clear(self) -> None:
        self._free = list(range(len(self.lengths) - 1, -1, -1))
        self.lengths[:] = 0

    def num_blocks(self, row: int) -> int:
        return int(self.lengths[row])

    def table(self, row: int) -> list[int]:
        return self.array[row, :self.lengths[row]].tolist()

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), w] int32 with w the longest of the rows' tables. Columns past a row's own
        length hold ids of earlier tables (valid block ids, never read by the kernels: they stop
        at each sequence's length)."""
        width = int(self.lengths[rows].max()) if len(rows) else 0
        return self.array[rows, :width]

    def _grow(self) -> None:
        old = len(self.lengths)
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free = list(range(2 * old - 1, old - 1, -1))
