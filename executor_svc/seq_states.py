"""SeqStates: the runner's per-seq token ids and counters as rows of numpy arrays (vLLM's
persistent batch, rows shared with BlockTables); RowIndex: which row holds which seq. Numpy only.
"""
from __future__ import annotations

import numpy as np


class SeqStates:
    def __init__(self, max_model_len: int, rows: int = 64) -> None:
        # A seq holds at most max_model_len tokens computed plus the one it samples after them.
        self.width = max_model_len + 1
        self.token_ids = np.zeros((rows, self.width), dtype=np.int32)  # [rows, width]
        self.num_known = np.zeros(rows, dtype=np.int64)  # tokens whose ids are on the host
        # num_known + the tokens sampled by steps launched but not finished (on the device)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.greedy = np.zeros(rows, dtype=bool)
        # A row's registration, so that a step finishing after its seq was dropped, and its row
        # given to another seq, writes nothing into that row.
        self.generation = np.zeros(rows, dtype=np.int64)
        self._next_generation = 1

    def add(self, row: int, token_ids: list[int] | np.ndarray, num_computed: int,
            greedy: bool, first: int = 0) -> None:
        """Row `row` (of BlockTables) now holds a new seq with these tokens from position
        `first` on (those before it, in the KV cache already, are never read: 0 stands for
        them)."""
        if row >= len(self.num_known):
            self._grow(row + 1)
        n = first + len(token_ids)
        self.token_ids[row, :first] = 0
        self.token_ids[row, first:n] = token_ids
        self.num_known[row] = self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.greedy[row] = greedy
        self.generation[row] = self._next_generation
        self._next_generation += 1

    def tokens(self, row: int) -> np.ndarray:
        """The row's tokens known on the host: a view (writes go to the state)."""
        return self.token_ids[row, :self.num_known[row]]

    def input_positions(self, rows: np.ndarray, num_scheduled: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
        """The packed batch's (row, position) of each input token: seq i computes positions
        [num_computed, + num_scheduled) of its row. Both [num_tokens] int64."""
        starts = np.cumsum(num_scheduled) - num_scheduled  # [num_seqs]
        token_rows = np.repeat(rows, num_scheduled)  # [num_tokens]
        positions = (np.repeat(self.num_computed[rows] - starts, num_scheduled)
                     + np.arange(len(token_rows)))  # [num_tokens]
        return token_rows, positions

    def record_sampled(self, rows: np.ndarray, generations: np.ndarray, positions: np.ndarray,
                       token_ids: np.ndarray) -> None:
        """A finished step's sampled ids, token_ids[i] at positions[i] of rows[i], for the rows
        still held by the seq that sampled (same generation). Steps finish in launch order."""
        held = self.generation[rows] == generations
        rows, positions = rows[held], positions[held]
        self.token_ids[rows, positions] = token_ids[held]
        self.num_known[rows] = positions + 1

    def _grow(self, rows: int) -> None:
        new = max(rows, 2 * len(self.num_known))
        # Only the columns that hold tokens are copied: the rest of the new array stays untouched
        # zero pages (rows * (max_model_len + 1) * 4 bytes would be 512 MiB at 1,024 rows of a
        # 128k-token model; the host memory used follows the tokens held instead).
        used = int(self.num_known.max())
        token_ids = np.zeros((new, self.width), dtype=self.token_ids.dtype)
        token_ids[:len(self.num_known), :used] = self.token_ids[:, :used]
        self.token_ids = token_ids
        for name in ("num_known", "num_tokens", "num_computed", "greedy", "generation"):
            old = getattr(self, name)
            grown = np.zeros(new, dtype=old.dtype)
            grown[:len(old)] = old
            setattr(self, name, grown)


class RowIndex:
    """seq_id -> row as two arrays sorted by seq id: a plan's column of ids is looked up with one
    binary search rather than a dict read per seq."""

    def __init__(self) -> None:
        self.seq_ids = np.zeros(0, dtype=np.uint64)  # [num_seqs], sorted
        self.row_of = np.zeros(0, dtype=np.int64)  # [num_seqs]

    # Slices joined rather than np.insert / np.delete, which cost more in their general-case
    # argument handling than the work itself.
    def add(self, seq_id: int, row: int) -> None:
        i = int(np.searchsorted(self.seq_ids, np.uint64(seq_id)))
        self.seq_ids = np.concatenate(
            (self.seq_ids[:i], np.array([seq_id], dtype=np.uint64), self.seq_ids[i:]))
        self.row_of = np.concatenate(
            (self.row_of[:i], np.array([row], dtype=np.int64), self.row_of[i:]))

    def remove(self, seq_id: int) -> None:
        i = int(np.searchsorted(self.seq_ids, np.uint64(seq_id)))
        self.seq_ids = np.concatenate((self.seq_ids[:i], self.seq_ids[i + 1:]))
        self.row_of = np.concatenate((self.row_of[:i], self.row_of[i + 1:]))

    def rows(self, seq_ids: np.ndarray) -> np.ndarray:
        """[n] int64: each seq's row, -1 for a seq not held."""
        if not len(self.seq_ids):
            return np.full(len(seq_ids), -1, dtype=np.int64)
        i = np.minimum(np.searchsorted(self.seq_ids, seq_ids), len(self.seq_ids) - 1)
        return np.where(self.seq_ids[i] == seq_ids, self.row_of[i], -1)
