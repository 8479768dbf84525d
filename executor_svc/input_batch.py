"""InputBatch: the one owner of the executor's per-seq rows (vLLM's persistent batch): which row
holds which seq, and each row's block table, token ids, counters, sampling options and penalty
counts. Imports numpy and torch (through TokenCounts) only; nothing of gRPC or the model.
"""
from __future__ import annotations

import numpy as np
import torch

from executor_svc.block_tables import BlockTables
from executor_svc.step import SamplingOptions
from executor_svc.structured_output import GrammarCompiler, GrammarRows
from executor_svc.token_counts import TokenCounts

_COLUMNS = ("num_known", "num_tokens", "num_computed", "greedy", "occupancy")


class InputBatch:
    """Rows persist across steps and are written only through these methods; the runner reads
    the columns (`token_ids`, `num_known`, `num_tokens`, `num_computed`, `greedy`, `occupancy`,
    `block_table`, `sampling`, `count_row`) when it builds a step, indexed by row. A freed row
    is given to the next seq added (low rows first on a fresh batch); the arrays double when
    every row is held."""

    def __init__(self, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device, rows: int = 64,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        # A seq holds at most max_model_len tokens computed plus the one it samples after them.
        self.max_num_tokens = max_model_len + 1
        self.block_table = BlockTables(-(-max_model_len // block_size), rows)
        self.token_ids = np.zeros((rows, self.max_num_tokens), dtype=np.int32)  # [rows, width]
        self.num_known = np.zeros(rows, dtype=np.int64)  # tokens whose ids are on the host
        # num_known + the tokens sampled by steps launched but not finished (on the device)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.greedy = np.zeros(rows, dtype=bool)
        # Which seq's stay in the row this is (a number never reused): a step finishing after
        # its seq was dropped, and the row given to another, then writes nothing into it.
        self.occupancy = np.zeros(rows, dtype=np.int64)
        self._next_occupancy = 1
        self.sampling: list[SamplingOptions | None] = [None] * rows  # by row
        self.count_row: list[int | None] = [None] * rows  # by row: of token_counts, if penalised
        self.token_counts = TokenCounts(vocab_size, device)  # rows only for penalised seqs
        self.num_controlled = 0  # held seqs using a penalty, a logit bias or logprobs
        self.grammars = GrammarRows(grammar_compiler)  # the rows of seqs that follow a grammar
        self._index = RowIndex()
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: low rows first

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, seq_id: int) -> bool:
        return self._index.row(seq_id) is not None

    @property
    def capacity(self) -> int:
        """Rows allocated, held or free."""
        return len(self.num_known)

    @property
    def seq_ids(self) -> list[int]:
        """The held seqs, ascending."""
        return self._index.seq_ids.tolist()

    def row(self, seq_id: int) -> int | None:
        """A held seq's row; None if it is not held."""
        return self._index.row(seq_id)

    def rows(self, seq_ids: np.ndarray) -> np.ndarray:
        """[n] int64: each seq's row, -1 for a seq not held (one binary search for the column)."""
        return self._index.rows(seq_ids)

    def add(self, seq_id: int, token_ids: np.ndarray, block_table: list[int], num_computed: int,
            sampling: SamplingOptions, first_position: int = 0,
            num_prompt_tokens: int | None = None) -> int:
        """Holds a new seq; returns its row. token_ids: its tokens from `first_position` on (those
        before it, in the KV cache already, are never read: 0 stands for them);
        token_ids[:num_prompt_tokens] are its prompt (None: all are)."""
        if sampling.uses_penalties and first_position:
            raise ValueError("a penalty counts every token: first_position must be 0")
        if not self._free:
            self._grow()
        row = self._free[-1]
        self._index.add(seq_id, row)  # raises, changing nothing, if the seq is held already
        self._free.pop()
        self.block_table.set(row, block_table)
        n = first_position + len(token_ids)
        self.token_ids[row, :first_position] = 0
        self.token_ids[row, first_position:n] = token_ids
        self.num_known[row] = self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.greedy[row] = sampling.temperature <= 0.0
        self.occupancy[row] = self._next_occupancy
        self._next_occupancy += 1
        self.sampling[row] = sampling
        if sampling.uses_penalties:  # counts rebuilt from the plan's ids, prompt apart
            num_prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
            self.count_row[row] = self.token_counts.add(token_ids[:num_prompt],
                                                        token_ids[num_prompt:])
        self.num_controlled += sampling.has_controls
        if sampling.grammar:  # its matcher replays the generated tokens
            start = n if num_prompt_tokens is None else num_prompt_tokens
            self.grammars.add(row, sampling.grammar, self.token_ids[row, start:n], n)
        return row

    def remove(self, seq_id: int) -> int | None:
        """Forgets a seq (finished or preempted) and frees its row; returns the row, or None if
        the seq was not held."""
        row = self._index.remove(seq_id)
        if row is None:
            return None
        sampling, self.sampling[row] = self.sampling[row], None
        if self.count_row[row] is not None:
            self.token_counts.free(self.count_row[row])
            self.count_row[row] = None
        self.num_controlled -= sampling.has_controls
        self.grammars.remove(row)
        self._free.append(row)
        return row

    def clear(self) -> None:
        """Forgets every seq (keeps the arrays, and the occupancy count, for reuse)."""
        self._index = RowIndex()
        self._free = list(range(self.capacity - 1, -1, -1))
        self.block_table.lengths[:] = 0
        self.num_known[:] = self.num_tokens[:] = self.num_computed[:] = 0
        self.sampling = [None] * self.capacity
        self.count_row = [None] * self.capacity
        self.token_counts.clear()
        self.num_controlled = 0
        self.grammars.clear()

    def append_blocks(self, rows: np.ndarray, counts: np.ndarray, block_ids: np.ndarray) -> None:
        """Appends counts[i] block ids to the table of rows[i] (distinct rows), in turn."""
        if len(block_ids):
            self.block_table.append_many(rows, counts, block_ids)

    def tokens(self, row: int) -> np.ndarray:
        """The row's tokens known on the host: a view (writes go to the batch)."""
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

    def advance(self, rows: np.ndarray, num_computed: np.ndarray,
                sampled_rows: np.ndarray) -> None:
        """A step launched: rows[i] (distinct) has num_computed[i] tokens computed after it, and
        each of sampled_rows one more token, its id on the device until the step finishes."""
        self.num_computed[rows] = num_computed
        self.num_tokens[sampled_rows] += 1

    def record_sampled(self, rows: np.ndarray, occupancies: np.ndarray, positions: np.ndarray,
                       token_ids: np.ndarray) -> None:
        """A finished step's sampled ids, token_ids[i] at positions[i] of rows[i], for the rows
        still held by the seq that sampled (same occupancy), in launch order. Recording a step
        again (after a grammar waited for its tokens) changes nothing."""
        held = self.occupancy[rows] == occupancies
        rows, positions = rows[held], positions[held]
        self.token_ids[rows, positions] = token_ids[held]
        self.num_known[rows] = np.maximum(self.num_known[rows], positions + 1)

    def all_greedy_plain(self, rows: np.ndarray) -> bool:
        """Whether these rows sample greedily and no held seq uses a control (the common batch,
        whose sampling needs no look at each seq's options)."""
        return not self.num_controlled and bool(self.greedy[rows].all())

    def sampling_of(self, rows: np.ndarray) -> list[SamplingOptions]:
        sampling = self.sampling
        return [sampling[row] for row in rows.tolist()]

    def count_rows_of(self, rows: np.ndarray) -> list[int | None] | None:
        """The rows' rows of token_counts (None for one without a penalty); None when no held
        seq uses a control."""
        if not self.num_controlled:
            return None
        count_row = self.count_row
        return [count_row[row] for row in rows.tolist()]

    def logprobs_asked(self, rows: np.ndarray) -> list[tuple[int, int]]:
        """(i, k) for each rows[i] whose seq asked for logprobs and k top ones."""
        if not self.num_controlled:
            return []
        sampling = self.sampling
        return [(i, k) for i, row in enumerate(rows.tolist())
                if (k := sampling[row].logprobs) is not None]

    def _grow(self) -> None:
        old = self.capacity
        new = 2 * old
        # Only the columns that hold tokens are copied: the rest of the new array stays untouched
        # zero pages (rows * (max_model_len + 1) * 4 bytes would be 512 MiB at 1,024 rows of a
        # 128k-token model; the host memory used follows the tokens held instead).
        used = int(self.num_known.max())
        token_ids = np.zeros((new, self.max_num_tokens), dtype=self.token_ids.dtype)
        token_ids[:old, :used] = self.token_ids[:, :used]
        self.token_ids = token_ids
        for name in _COLUMNS:
            column = getattr(self, name)
            grown = np.zeros(new, dtype=column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
        self.block_table.grow(new)
        self.sampling += [None] * old
        self.count_row += [None] * old
        self._free = list(range(new - 1, old - 1, -1))


class RowIndex:
    """seq_id -> row, for one id (a dict read) or a plan's column of ids (one binary search over
    two arrays sorted by seq id, rather than a dict read per seq)."""

    def __init__(self) -> None:
        self._row: dict[int, int] = {}
        self.seq_ids = np.zeros(0, dtype=np.uint64)  # [num_seqs], sorted
        self.row_of = np.zeros(0, dtype=np.int64)  # [num_seqs]

    def __len__(self) -> int:
        return len(self._row)

    def row(self, seq_id: int) -> int | None:
        return self._row.get(seq_id)

    # Slices joined rather than np.insert / np.delete, which cost more in their general-case
    # argument handling than the work itself.
    def add(self, seq_id: int, row: int) -> None:
        if seq_id in self._row:
            raise ValueError(f"seq {seq_id} is held already")
        self._row[seq_id] = row
        i = int(np.searchsorted(self.seq_ids, np.uint64(seq_id)))
        self.seq_ids = np.concatenate(
            (self.seq_ids[:i], np.array([seq_id], dtype=np.uint64), self.seq_ids[i:]))
        self.row_of = np.concatenate(
            (self.row_of[:i], np.array([row], dtype=np.int64), self.row_of[i:]))

    def remove(self, seq_id: int) -> int | None:
        """Forgets the seq; returns its row, or None if it was not held."""
        row = self._row.pop(seq_id, None)
        if row is None:
            return None
        i = int(np.searchsorted(self.seq_ids, np.uint64(seq_id)))
        self.seq_ids = np.concatenate((self.seq_ids[:i], self.seq_ids[i + 1:]))
        self.row_of = np.concatenate((self.row_of[:i], self.row_of[i + 1:]))
        return row

    def rows(self, seq_ids: np.ndarray) -> np.ndarray:
        """[n] int64: each seq's row, -1 for a seq not held."""
        if not len(self.seq_ids):
            return np.full(len(seq_ids), -1, dtype=np.int64)
        i = np.minimum(np.searchsorted(self.seq_ids, seq_ids), len(self.seq_ids) - 1)
        return np.where(self.seq_ids[i] == seq_ids, self.row_of[i], -1)
