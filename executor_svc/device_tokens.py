"""DeviceTokens: input ids a step takes from the device, because the step that sampled them is
launched but not finished (their values are not on the host yet). Imports torch and numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from executor_svc.attention_metadata import to_device


@dataclass(frozen=True)
class DeviceTokens:
    """Packed input row dst_rows[i] takes sampled[src_rows[i]]; a device gather, no host sync."""

    sampled: torch.Tensor  # [num_sampled] int64 on the device: the sampled ids of unfinished steps
    src_rows: np.ndarray  # [m] int64
    dst_rows: np.ndarray  # [m] int64

    def scatter_into(self, input_ids: torch.Tensor,
                     rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """input_ids[dst_rows] = sampled[src_rows] on the device. rows: (src, dst) int64 index
        tensors already on the device (e.g. staged with other inputs); else copied here."""
        if rows is None:
            both = to_device(torch.from_numpy(np.stack([self.src_rows, self.dst_rows])
                                              .astype(np.int64)), input_ids.device)  # [2, m]
            rows = both[0], both[1]
        input_ids.index_copy_(0, rows[1], self.sampled.index_select(0, rows[0]))
