"""TokenCounts: per-seq prompt masks and generated-token counts on the logits' device, for the
repetition, presence and frequency penalties; updated on the device only. Imports torch only.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from executor_svc.attention_metadata import to_device

_FIRST_ROWS = 8


class TokenCounts:
    """Rows only for seqs that use a penalty, tensors made when the first arrives, so a batch
    without penalties costs nothing. Dense rows ([rows, vocab], 5 bytes a token) rather than
    vLLM's token-id lists binned every step: a step is one gather and one scatter, whatever the
    seqs' lengths. The decode graphs read these tensors, so `reserve` makes rows for a full graph
    batch plus a neutral all-zero row; growing past it makes new tensors, which the graphs notice
    (GraphSampler then samples eagerly)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.prompt_mask: torch.Tensor | None = None  # [rows, vocab] bool: in the prompt
        self.output_counts: torch.Tensor | None = None  # [rows, vocab] int32: times generated
        self._free: list[int] = []
        self.neutral_row: int | None = None  # set by reserve()

    @property
    def num_rows(self) -> int:
        return 0 if self.output_counts is None else self.output_counts.shape[0]

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """A row counting these tokens (lists or int arrays; queued on the device); returns its
        index."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.prompt_mask[row] = False
        self.output_counts[row] = 0
        if len(prompt_ids):
            self.prompt_mask[row, self._ids(prompt_ids)] = True
        if len(output_ids):
            ids = self._ids(output_ids)
            self.output_counts[row].index_add_(
                0, ids, torch.ones(ids.shape, dtype=torch.int32, device=self.device))
        return row

    def free(self, row: int) -> None:
        self._free.append(row)

    def clear(self) -> None:
        """Forget every row (keeps the tensors for reuse)."""
        self._free = [r for r in range(self.num_rows - 1, -1, -1) if r != self.neutral_row]

    def reserve(self, num_rows: int) -> None:
        """Makes room for num_rows seqs and a neutral row now (once; the rows held are kept)."""
        if self.neutral_row is not None:
            return
        if self.num_rows < num_rows + 1:
            self._grow(num_rows + 1)
        self.neutral_row = self.num_rows - 1
        self._free.remove(self.neutral_row)

    def count(self, rows: torch.Tensor, token_ids: torch.Tensor,
              weights: torch.Tensor | None = None) -> None:
        """Adds one sampled token to each row (weights[i] of them: int32, 0 counts nothing), on
        the device: rows, token_ids [m] int64. One index_add_ into the flat counts (a plain
        kernel: no sort, safe inside a CUDA graph)."""
        if weights is None:
            weights = torch.ones(rows.shape, dtype=torch.int32, device=self.device)
        self.output_counts.view(-1).index_add_(0, rows * self.vocab_size + token_ids, weights)

    @staticmethod
    def bytes_for(num_rows: int, vocab_size: int) -> int:
        """Device bytes of reserve(num_rows): int32 counts and a bool prompt mask a token."""
        return (num_rows + 1) * vocab_size * 5

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' prompt masks and output counts: [m, vocab] bool and int32."""
        return self.prompt_mask[rows], self.output_counts[rows]

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return to_device(torch.as_tensor(ids, dtype=torch.int64), self.device)

    def _grow(self, rows: int | None = None) -> None:
        """Doubles the rows, or makes them `rows` (device copies, no host sync)."""
        old = self.num_rows
        new = rows or max(_FIRST_ROWS, 2 * old)
        # Normal tensors even when made under inference mode (the memory profile and the graph
        # sampler reserve inside it): rows are then written outside it, which an inference
        # tensor refuses.
        with torch.inference_mode(False):
            mask = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        if old:
            mask[:old] = self.prompt_mask
            counts[:old] = self.output_counts
        self.prompt_mask, self.output_counts = mask, counts
        self._free = list(range(new - 1, old - 1, -1)) + self._free
