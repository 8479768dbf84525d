"""HostStaging: a graph step's inputs, packed on the host into pinned int64 buffers taken in
turn, reach the device in one copy into a twin the graphs' static buffers are filled from, so
packing a step never waits for the GPU. Imports torch and numpy only.
"""
from __future__ import annotations

import numpy as np
import torch

# A step is packed while the previous one may still be queued (launched, not finished), so its
# buffer may not have been copied out yet.
_NUM_BUFFERS = 2


class HostStaging:
    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
                      for _ in range(_NUM_BUFFERS)]
        self._host_np = [h.numpy() for h in self._host]
        # Recorded after each buffer's copy; the twin is only read in stream order, so one twin
        # serves every buffer.
        self._copied = [torch.cuda.Event() if cuda else None for _ in self._host]
        self._turn = self._taken = 0
        self.twin = torch.zeros_like(self._host[0], device=device)  # [size] int64

    def take(self) -> np.ndarray:
        """The next buffer to pack, once the copy out of its last contents has run: with at most
        two steps unfinished that copy is long done and nothing waits."""
        k = self._taken = self._turn
        self._turn = (k + 1) % len(self._host)
        event = self._copied[k]
        if event is not None:
            event.synchronize()  # returns at once when the copy is long done
        return self._host_np[k]

    def send(self, start: int, end: int) -> torch.Tensor:
        """Queues the copy of [start, end) of the buffer taken last into the twin, without
        waiting; returns the twin."""
        k = self._taken
        self.twin[start:end].copy_(self._host[k][start:end], non_blocking=True)
        if self._copied[k] is not None:
            self._copied[k].record()
        return self.twin
