"""A pool of physical blocks of one device (GPU or CPU): FIFO free list and ref counts.
Knows nothing of sequences; the BlockManager maps sequences to blocks."""

from collections import deque


class BlockPool:
    """Blocks 0..num_blocks-1. A block is free iff its ref count is 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # Blocks with more than one reference. Read-only outside: while it is 0 no write can
        # need a copy, and the block manager skips that check on every decode step.
        self.num_shared = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        """Take the oldest free block, with ref count 1."""
        if not self._free:
            raise RuntimeError("BlockPool: no free blocks")
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        return block_id

    def allocate_n(self, n: int) -> list[int]:
        """All n blocks or none (RuntimeError)."""
        if not self.can_allocate(n):
            raise RuntimeError(f"BlockPool: {n} blocks asked, {len(self._free)} free")
        return [self.allocate() for _ in range(n)]

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def incref(self, block_id: int) -> None:
        if self._ref_counts[block_id] < 1:
            raise RuntimeError(f"BlockPool: incref of free block {block_id}")
        self._ref_counts[block_id] += 1
        if self._ref_counts[block_id] == 2:
            self.num_shared += 1

    def free(self, block_id: int) -> int:
        """Drop one reference; the block returns to the free list at 0. Returns the new count."""
        if self._ref_counts[block_id] < 1:
            raise RuntimeError(f"BlockPool: double free of block {block_id}")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 1:
            self.num_shared -= 1
        elif self._ref_counts[block_id] == 0:
            self._free.append(block_id)
        return self._ref_counts[block_id]

    def check_invariants(self, table_refs: dict[int, int], name: str) -> None:
        """table_refs: block_id -> number of page-table references to it."""
        free = set(self._free)
        assert len(free) == len(self._free), f"{name}: duplicate ids in the free list"
        for block_id, ref in enumerate(self._ref_counts):
            want = table_refs.get(block_id, 0)
            assert ref == want, f"{name}: block {block_id} ref count {ref}, {want} table refs"
            assert (ref == 0) == (block_id in free), f"{name}: block {block_id} free xor mapped broken"
        assert set(table_refs) <= set(range(self.num_blocks)), f"{name}: table names unknown block"
        assert self.num_free + self.num_used == self.num_blocks, f"{name}: capacity not conserved"
        shared = sum(1 for ref in self._ref_counts if ref > 1)
        assert self.num_shared == shared, f"{name}: num_shared {self.num_shared}, {shared} shared"
