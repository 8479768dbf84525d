"""Per-step attention metadata (positions, slots, packed query offsets, block tables), derived on
the executor from block tables and token counts. Imports torch only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, slot = block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length incl. this step's tokens
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode_only: bool  # every seq has exactly one query token


def build_attention_metadata(
    block_tables: list[list[int]],
    num_computed_tokens: list[int],
    num_scheduled_tokens: list[int],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions [num_tokens] int64 and the metadata for one packed batch of sequences.

    Sequence i computes positions [num_computed_tokens[i], + num_scheduled_tokens[i]); its block
    table must cover them.
    """
    positions = torch.cat([
        torch.arange(start, start + n, dtype=torch.int64)
        for start, n in zip(num_computed_tokens, num_scheduled_tokens)
    ])  # [num_tokens]
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.zeros(len(block_tables), max_blocks, dtype=torch.int64)  # [num_seqs, max_blocks]
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)
    seq_index = torch.repeat_interleave(
        torch.arange(len(block_tables)), torch.tensor(num_scheduled_tokens)
    )  # [num_tokens]: which seq each token belongs to
    block_ids = tables[seq_index, positions // block_size]
    slot_mapping = block_ids * block_size + positions % block_size  # [num_tokens]
    query_lens = torch.tensor(num_scheduled_tokens, dtype=torch.int32)
    cu_seqlens_q = torch.zeros(len(block_tables) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.cumsum(query_lens, 0)
    seq_lens = torch.tensor(
        [c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens)], dtype=torch.int32
    )
    metadata = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        block_tables=to_device(tables.to(torch.int32), device),
        cu_seqlens_q=to_device(cu_seqlens_q, device),
        seq_lens=to_device(seq_lens, device),
        max_seqlen_q=max(num_scheduled_tokens),
        max_seqlen_k=int(seq_lens.max()),
        is_decode_only=all(n == 1 for n in num_scheduled_tokens),
    )
    return to_device(positions, device), metadata


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory without blocking the host, so
    building a step's inputs never waits for the GPU."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
