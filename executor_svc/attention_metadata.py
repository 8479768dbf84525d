"""Per-step attention metadata (positions, slots, packed query offsets, block tables), derived on
the executor from block tables and token counts. Imports torch and numpy only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefillPart:
    """The seqs of a mixed step after its leading single-token ones, for the prefill kernel."""

    block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor  # [num_prefill_seqs + 1] int32, from 0
    seq_lens: torch.Tensor  # [num_prefill_seqs] int32


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, slot = block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. this step's tokens
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode_only: bool  # every seq has exactly one query token
    # A mixed step's first `num_decodes` seqs have one query token each: they take the decode
    # kernel (a prefill kernel would spend a whole query tile on each), `prefill` the rest.
    # 0 and None when the step is decode only or starts with a longer seq.
    num_decodes: int = 0
    prefill: PrefillPart | None = None


def build_attention_metadata(
    block_tables: list[list[int]] | np.ndarray,
    num_computed_tokens: list[int] | np.ndarray,
    num_scheduled_tokens: list[int] | np.ndarray,
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [num_tokens] int64 and the metadata for one packed batch of sequences.

    Sequence i computes positions [num_computed_tokens[i], + num_scheduled_tokens[i]); its block
    table must cover them. block_tables: one list per seq, or an int array [num_seqs, width]
    whose row i starts with seq i's table (later columns are never read). A few numpy ops over
    the whole batch (cheaper than torch's on arrays this small), no per-sequence work.
    """
    num_seqs = len(block_tables)
    query_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)  # [num_seqs]
    tables = (block_tables if isinstance(block_tables, np.ndarray)
              else _padded(block_tables))  # [num_seqs, max_blocks]
    host = host_metadata(tables, num_computed_tokens, query_lens, block_size)
    positions, slot_mapping, cu_seqlens_q, seq_lens = host
    tables_d = _to_device(tables, np.int32, device)
    seq_lens_d = _to_device(seq_lens, np.int32, device)
    num_decodes = _num_leading_ones(query_lens)
    prefill = None
    if 0 < num_decodes < num_seqs:
        rest = cu_seqlens_q[num_decodes:] - cu_seqlens_q[num_decodes]
        prefill = PrefillPart(tables_d[num_decodes:], _to_device(rest, np.int32, device),
                              seq_lens_d[num_decodes:])
    metadata = AttentionMetadata(
        slot_mapping=_to_device(slot_mapping, np.int64, device),
        block_tables=tables_d,
        cu_seqlens_q=_to_device(cu_seqlens_q, np.int32, device),
        seq_lens=seq_lens_d,
        max_seqlen_q=int(query_lens.max()),
        max_seqlen_k=int(seq_lens.max()),
        is_decode_only=num_decodes == num_seqs,
        num_decodes=num_decodes if prefill is not None else 0,
        prefill=prefill,
    )
    return _to_device(positions, np.int64, device), metadata


def host_metadata(tables: np.ndarray, num_computed_tokens, num_scheduled_tokens, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The step's metadata on the host, int64 numpy: positions and slot_mapping [num_tokens],
    cu_seqlens_q [num_seqs + 1], seq_lens [num_seqs]. tables: [num_seqs, width], row i starting
    with seq i's table; it must cover the scheduled positions."""
    query_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)  # [num_seqs]
    seq_lens = np.asarray(num_computed_tokens, dtype=np.int64) + query_lens  # [num_seqs]
    cu_seqlens_q = np.zeros(len(query_lens) + 1, dtype=np.int64)  # [num_seqs + 1]
    np.cumsum(query_lens, out=cu_seqlens_q[1:])
    seq_index = np.repeat(np.arange(len(query_lens)), query_lens)  # [num_tokens]
    # position of token t of seq i: its seq's first new position + its offset among them
    positions = ((seq_lens - query_lens - cu_seqlens_q[:-1])[seq_index]
                 + np.arange(len(seq_index)))  # [num_tokens]
    block_ids = tables[seq_index, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + positions % block_size  # [num_tokens]
    return positions, slot_mapping, cu_seqlens_q, seq_lens


def _to_device(array: np.ndarray, dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)), device)


def _padded(block_tables: list[list[int]]) -> np.ndarray:
    """[num_seqs, max_blocks] int64, each row a table padded with 0, from one flat array."""
    lengths = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    tables = np.zeros((len(block_tables), int(lengths.max())), dtype=np.int64)
    # np.fromiter reads the tables' Python ints much faster than torch.tensor(list)
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), np.int64)
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = flat  # row-major, as flat
    return tables


def _num_leading_ones(num_scheduled_tokens: np.ndarray) -> int:
    others = np.flatnonzero(num_scheduled_tokens != 1)
    return int(others[0]) if len(others) else len(num_scheduled_tokens)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory without blocking the host, so
    building a step's inputs never waits for the GPU."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
