"""A pool of physical blocks of one device (GPU or CPU): the free queue (FIFO, which is LRU order
for prefix caching), ref counts, and the hashes of cached full blocks. Knows nothing of sequences;
the BlockManager maps sequences to blocks."""

from collections import OrderedDict


class BlockPool:
    """Blocks 0..num_blocks-1. A block is free iff its ref count is 0.

    A free block may still be cached (hold a hash and the KV of a full page): `touch` takes it
    back out of the free queue; `allocate` takes the head of the queue (least recently freed)
    and evicts its hash, as vLLM v1's free block queue.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # An ordered set: popitem(last=False) takes the head, del takes a cached block out of
        # the middle when a new sequence hits it; both O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_hashes: dict[int, bytes] = {}  # block_id -> hash of the page it holds
        self._cached: dict[bytes, int] = {}  # hash -> block_id
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a hashed full page, referenced or not."""
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        """Take the oldest free block, with ref count 1; a cached one loses its hash."""
        if not self._free:
            raise RuntimeError("BlockPool: no free blocks")
        block_id, _ = self._free.popitem(last=False)
        self._ref_counts[block_id] = 1
        if self._block_hashes:
            self._evict(block_id)
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

    def free(self, block_id: int) -> int:
        """Drop one reference; the block returns to the tail of the free queue at 0 (a cached
        block keeps its hash there until it is allocated). Returns the new count."""
        if self._ref_counts[block_id] < 1:
            raise RuntimeError(f"BlockPool: double free of block {block_id}")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
        return self._ref_counts[block_id]

    # ---- prefix caching ----------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the page of this hash, or None."""
        return self._cached.get(block_hash)

    def touch(self, block_id: int) -> None:
        """One more reference to a block whose KV is still wanted (a cached one, or a page the
        other device holds too), taking it out of the free queue if it was there."""
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
            self._ref_counts[block_id] = 1
        else:
            self.incref(block_id)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Record that a used block holds the full page of this hash. False (nothing recorded)
        when the block already has a hash or another block holds the page."""
        if block_id in self._block_hashes or block_hash in self._cached:
            return False
        assert self._ref_counts[block_id] > 0, f"BlockPool: caching free block {block_id}"
        self._block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._block_hashes

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash of the page this block holds, or None."""
        return self._block_hashes.get(block_id)

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hashes.pop(block_id, None)
        if block_hash is not None:
            del self._cached[block_hash]
            self.num_evicted += 1

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self, table_refs: dict[int, int], name: str) -> None:
        """table_refs: block_id -> number of page-table references to it."""
        free = set(self._free)
        for block_id, ref in enumerate(self._ref_counts):
            want = table_refs.get(block_id, 0)
            assert ref == want, f"{name}: block {block_id} ref count {ref}, {want} table refs"
            assert (ref == 0) == (block_id in free), f"{name}: block {block_id} free xor mapped broken"
        assert set(table_refs) <= set(range(self.num_blocks)), f"{name}: table names unknown block"
        assert self.num_free + self.num_used == self.num_blocks, f"{name}: capacity not conserved"
        assert len(self._cached) == len(self._block_hashes), f"{name}: hash maps disagree"
        for block_hash, block_id in self._cached.items():
            assert self._block_hashes.get(block_id) == block_hash, f"{name}: hash maps disagree"
