"""BlockTables: the block-table columns of the InputBatch, one row per held seq in one persistent
numpy array, so a step gathers its rows in one indexing operation. Rows are given out by the
InputBatch, not here. Numpy only.
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, rows: int) -> None:
        self.width = max_blocks_per_seq
        self.array = np.zeros((rows, self.width), dtype=np.int32)  # [rows, width]; see gather
        self.lengths = np.zeros(rows, dtype=np.int64)  # [rows]: blocks held by each row

    def set(self, row: int, block_ids: list[int]) -> None:
        """Row `row` now holds exactly `block_ids`."""
        self.lengths[row] = 0
        self.append(row, block_ids)

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

    def table(self, row: int) -> list[int]:
        return self.array[row, :self.lengths[row]].tolist()

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), w] int32 with w the longest of the rows' tables. Columns past a row's own
        length hold ids of earlier tables (valid block ids, never read by the kernels: they stop
        at each sequence's length)."""
        width = int(self.lengths[rows].max()) if len(rows) else 0
        return self.array[rows, :width]

    def grow(self, rows: int) -> None:
        """Makes room for `rows` rows; the rows held keep their tables."""
        old = len(self.lengths)
        array = np.zeros((rows, self.width), dtype=self.array.dtype)
        array[:old] = self.array
        lengths = np.zeros(rows, dtype=self.lengths.dtype)
        lengths[:old] = self.lengths
        self.array, self.lengths = array, lengths
