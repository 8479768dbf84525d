"""DeviceTokens: input ids a step takes from the device, because the step that sampled them is
launched but not finished (their values are not on the host yet). Imports torch only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.attention_metadata import to_device


@dataclass(frozen=True)
class DeviceTokens:
    """Packed input row dst_rows[i] takes sampled[src_rows[i]]; a device gather, no host sync."""

    sampled: torch.Tensor  # [num_sampled] int64 on the device: the sampled ids of unfinished steps
    src_rows: list[int]
    dst_rows: list[int]

    @classmethod
    def collect(cls, sources: list[tuple[torch.Tensor, int]],
                dst_rows: list[int]) -> "DeviceTokens | None":
        """From one (sampled ids of a step, row) per input row; None when there are none."""
        if not sources:
            return None
        tensors = list({id(t): t for t, _ in sources}.values())  # almost always one step's
        offsets, start = {}, 0
        for t in tensors:
            offsets[id(t)] = start
            start += t.shape[0]
        sampled = tensors[0] if len(tensors) == 1 else torch.cat(tensors)  # [num_sampled]
        return cls(sampled, [offsets[id(t)] + row for t, row in sources], list(dst_rows))

    def scatter_into(self, input_ids: torch.Tensor,
                     rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """input_ids[dst_rows] = sampled[src_rows] on the device. rows: (src, dst) int64 index
        tensors already on the device (e.g. staged with other inputs); else copied here."""
        if rows is None:
            both = to_device(torch.tensor([self.src_rows, self.dst_rows], dtype=torch.int64),
                             input_ids.device)  # [2, m]
            rows = both[0], both[1]
        input_ids.index_copy_(0, rows[1], self.sampled.index_select(0, rows[0]))
