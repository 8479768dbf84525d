"""The page tables: which physical GPU (or CPU, when swapped) block holds each logical page of
each sequence, and the prefix cache of full pages. The only owner of page tables and of both block
pools. Plain Python only."""

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler_svc.block_pool import BlockPool


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full page: SHA-256 over its predecessor's hash and its token ids, so that
    equal hashes mean equal prefixes (a cryptographic hash: one tenant cannot forge another's
    page). The first page's parent is the salt (the model fingerprint)."""
    return _hash_page(parent, array("q", token_ids).tobytes())


def _hash_page(parent: bytes, page: bytes) -> bytes:
    """hash_block of a page whose ids are already packed (int64, native order)."""
    return hashlib.sha256(parent + page).digest()


@dataclass(slots=True)
class _Tier:
    """One device's side of the page tables: its pool, the tables of the seqs it holds, and
    `peers`: for a full page without a hash that both devices hold, each block referenced, the
    block on the other device (what a hash does for a hashed page: another seq moving the page
    to that device shares the block there instead of copying it again)."""

    pool: BlockPool
    tables: dict[int, list[int]] = field(default_factory=dict)
    peers: dict[int, int] = field(default_factory=dict)


class BlockManager:
    """Maps seq_id -> block_table on the GPU, and on the CPU for swapped sequences.

    Blocks may be shared between sequences (ref counted), only ever full ones, so no write
    lands in a shared block: by prefix caching, and by `fork_prompt` (parallel sampling: the
    full pages of the prompt shared, the page of its last token copied at the fork, the
    copy-on-write of the sample's first write).

    Prefix caching (vLLM v1's scheme), when enabled: a full GPU page whose KV is written is
    recorded under hash_block(parent hash, its tokens) by `cache_full_blocks`; a new sequence
    starts its table with the pages of its longest cached prefix (`find_cached_prefix`, then
    `allocate_slots(..., cached_block_ids=...)`). A page keeps its hash while unreferenced, in
    the free queue, until it is allocated again (LRU eviction). Only full pages are shared this
    way, so a shared page is never written and needs no copy.

    Swapping moves a seq's table to the other device, copying only the pages that device holds
    nowhere yet, so a page shared by k seqs is copied once each way, not k times. Both pools
    key full pages by hash: a copy of a hashed page is recorded under its hash on the other
    device too (the CPU pool keeps its own LRU of unreferenced cached pages), and a page whose
    hash that device holds, referenced or cached free, is shared there. An unhashed shared page
    (prefix caching off, or a duplicate of a cached one) is shared through `peers` while both
    of its blocks are referenced. The pages left behind are released, not freed: a page
    another seq holds stays with it, a cached page stays cached.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, *,
                 enable_prefix_caching: bool = False, cache_salt: str = "") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = cache_salt
        self._salt = hashlib.sha256(cache_salt.encode()).digest()
        self.reset()

    def reset(self) -> None:
        """Forget every mapping, hash and peer and free every block on both devices (used
        when the executor is lost: its KV is gone)."""
        self._gpu = _Tier(BlockPool(self.num_gpu_blocks))
        self._cpu = _Tier(BlockPool(self.num_cpu_blocks))
        # Tokens the table was last asked to cover: tells whether the last block is partial.
        self._num_slots: dict[int, int] = {}
        # Prefix caching: each seq's chain of full-page hashes (from its tokens), and how many
        # blocks at the start of its GPU table cache_full_blocks has seen.
        self._hashes: dict[int, list[bytes]] = {}
        self._num_cached_blocks: dict[int, int] = {}

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_free_gpu_blocks(self) -> int:
        return self._gpu.pool.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu.pool.num_free

    @property
    def num_used_gpu_blocks(self) -> int:
        return self._gpu.pool.num_used

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks in use, in [0, 1]."""
        return self._gpu.pool.num_used / self.num_gpu_blocks if self.num_gpu_blocks else 0.0

    @property
    def num_cached_gpu_blocks(self) -> int:
        """GPU pages held in the prefix cache, referenced or free."""
        return self._gpu.pool.num_cached

    @property
    def num_cached_cpu_blocks(self) -> int:
        """CPU pages held under their hash (copies of cached GPU pages), referenced or free."""
        return self._cpu.pool.num_cached

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, seq_id: int) -> list[int]:
        """A copy of the GPU block table (empty if the sequence has none)."""
        return list(self._gpu.tables.get(seq_id, ()))

    def get_cpu_block_table(self, seq_id: int) -> list[int]:
        return list(self._cpu.tables.get(seq_id, ()))

    # ---- growth --------------------------------------------------------------------------------

    def allocate_slots(self, seq_id: int, num_total_tokens: int,
                       cached_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Grow the GPU table of `seq_id` so it covers `num_total_tokens` tokens.

        Returns the block ids appended to the table, or None (and no change) when the GPU pool
        is short. `cached_block_ids` (from find_cached_prefix, for a seq without a table) start
        the table: they hold its first pages' KV already. The scheduler calls it for every seq
        of every step: a table that needs no new block costs a few dict reads.
        """
        if cached_block_ids and not self._take_cached_prefix(seq_id, cached_block_ids,
                                                             num_total_tokens):
            return None
        num_slots = self._num_slots
        if num_total_tokens <= num_slots.get(seq_id, 0):
            return []
        table = self._gpu.tables.get(seq_id)
        if table is None:
            if seq_id in self._cpu.tables:
                raise RuntimeError(f"seq {seq_id} is swapped out; swap it in first")
            table = []
        new_block_ids = []
        num_new_blocks = -(-num_total_tokens // self.block_size) - len(table)
        if num_new_blocks > 0:
            if not self._gpu.pool.can_allocate(num_new_blocks):
                return None
            new_block_ids = self._gpu.pool.allocate_n(num_new_blocks)
            table.extend(new_block_ids)
            self._gpu.tables[seq_id] = table
        num_slots[seq_id] = num_total_tokens
        return new_block_ids

    def _take_cached_prefix(self, seq_id: int, block_ids: Sequence[int],
                            num_total_tokens: int) -> bool:
        """Start seq_id's table with cached blocks if they and the rest of num_total_tokens fit
        (a cached block in the free queue counts against the free blocks); else no change."""
        if seq_id in self._gpu.tables or seq_id in self._cpu.tables:
            raise RuntimeError(f"seq {seq_id} already has blocks; a cached prefix starts a table")
        pool = self._gpu.pool
        num_free_hits = sum(1 for block_id in block_ids if pool.ref_count(block_id) == 0)
        num_new = max(0, self.num_blocks_needed(num_total_tokens) - len(block_ids))
        if not pool.can_allocate(num_new + num_free_hits):
            return False
        for block_id in block_ids:
            pool.touch(block_id)
        self._gpu.tables[seq_id] = list(block_ids)
        self._num_slots[seq_id] = len(block_ids) * self.block_size
        self._num_cached_blocks[seq_id] = len(block_ids)
        return True

    # ---- prefix caching ----------------------------------------------------------------------

    def _hash_chain(self, seq_id: int, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        """seq_id's full-page hashes, extended to at least num_blocks (tokens only grow)."""
        chain = self._hashes.setdefault(seq_id, [])
        if len(chain) >= num_blocks:
            return chain
        # hash_block, the new pages' ids packed at once rather than page by page
        size, first = self.block_size, len(chain)
        data = array("q", token_ids[first * size:num_blocks * size]).tobytes()
        parent, step = chain[-1] if chain else self._salt, size * 8
        for at in range(0, len(data), step):
            parent = _hash_page(parent, data[at:at + step])
            chain.append(parent)
        return chain

    def find_cached_prefix(self, seq_id: int, token_ids: Sequence[int]) -> list[int]:
        """The GPU blocks of the longest cached prefix of full pages of token_ids, at most
        len(token_ids) - 1 tokens (at least one token is computed, to sample from). Takes
        nothing: pass them to allocate_slots."""
        if not self.enable_prefix_caching:
            return []
        chain = self._hash_chain(seq_id, token_ids, (len(token_ids) - 1) // self.block_size)
        block_ids = []
        for block_hash in chain[:(len(token_ids) - 1) // self.block_size]:
            block_id = self._gpu.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> None:
        """Record the full pages among seq_id's first num_tokens tokens (their KV written by
        steps already sent, their token ids known) in the prefix cache."""
        table = self._gpu.tables.get(seq_id)
        if not self.enable_prefix_caching or table is None:
            return
        start = self._num_cached_blocks.get(seq_id, 0)
        end = min(num_tokens // self.block_size, len(table))
        if end <= start:
            return
        chain = self._hash_chain(seq_id, token_ids, end)
        for i in range(start, end):
            self._gpu.pool.cache(table[i], chain[i])
        self._num_cached_blocks[seq_id] = end

    def fork_prompt(self, parent_seq_id: int, child_seq_id: int, num_tokens: int,
                    copies: list[tuple[int, int]]) -> bool:
        """Parallel sampling: give the child a table covering num_tokens tokens (the prompt)
        whose first num_tokens - 1 hold the parent's KV. Full pages are shared (ref counted);
        the page of the last token is the child's own: a copy of the parent's, its (src, dst)
        pair appended to `copies`, when it holds some of the parent's tokens, else a fresh
        page. The child computes the last token itself (to sample from its logits), so no page
        is ever shared partially filled and neither side needs copy-on-write later. Needs one
        free GPU block; False, and no change, without one. The parent's KV of those tokens must
        be written by a plan sent before the one that carries the copy."""
        if child_seq_id in self._gpu.tables or child_seq_id in self._cpu.tables:
            raise RuntimeError(f"fork: seq {child_seq_id} already has blocks")
        parent = self._gpu.tables[parent_seq_id]
        num_shared, num_partial = divmod(num_tokens - 1, self.block_size)
        if len(parent) < num_shared + int(num_partial > 0):
            raise RuntimeError(f"fork: seq {parent_seq_id} does not cover {num_tokens - 1} tokens")
        pool = self._gpu.pool
        if not pool.can_allocate(1):
            return False
        table = parent[:num_shared]
        for block_id in table:
            pool.incref(block_id)
        block_id = pool.allocate()
        if num_partial:
            copies.append((parent[num_shared], block_id))
        table.append(block_id)
        self._gpu.tables[child_seq_id] = table
        self._num_slots[child_seq_id] = num_tokens
        self._num_cached_blocks[child_seq_id] = min(
            num_shared, self._num_cached_blocks.get(parent_seq_id, 0))
        return True

    # ---- swapping ----------------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        return self._can_move(self._gpu.tables.get(seq_id, ()), self._gpu, self._cpu, 0)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the table to the CPU; returns the (gpu, cpu) pairs the executor must copy: one
        for each page the CPU holds nowhere yet."""
        if not self.can_swap_out(seq_id):
            raise RuntimeError(f"swap_out: not enough CPU blocks for seq {seq_id}")
        self._num_cached_blocks.pop(seq_id, None)  # offered again from its first page once back
        return self._move(seq_id, self._gpu, self._cpu)

    def can_swap_in(self, seq_id: int, num_total_tokens: int = 0) -> bool:
        """Whether the table fits back on the GPU, with room to cover num_total_tokens."""
        table = self._cpu.tables.get(seq_id, ())
        num_growth = max(0, self.num_blocks_needed(num_total_tokens) - len(table))
        return self._can_move(table, self._cpu, self._gpu, num_growth)

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the table back to the GPU; returns the (cpu, gpu) pairs to copy: one for each
        page the GPU holds nowhere (a page another seq holds there, or cached free, is taken)."""
        if not self.can_swap_in(seq_id):
            raise RuntimeError(f"swap_in: not enough GPU blocks for seq {seq_id}")
        return self._move(seq_id, self._cpu, self._gpu)

    def _can_move(self, table: Sequence[int], src: _Tier, dst: _Tier, num_growth: int) -> bool:
        """Whether dst has the free blocks that moving `table` there (and num_growth more
        blocks) takes: one per page copied, one per page found in a free cached block."""
        num_free = dst.pool.num_free - num_growth
        if len(table) <= num_free:  # even if every page is copied
            return True
        num_taken = 0
        for block_id in table:
            found = self._find_on(dst, src, block_id)
            num_taken += found is None or dst.pool.ref_count(found) == 0
        return num_taken <= num_free

    def _find_on(self, dst: _Tier, src: _Tier, block_id: int) -> int | None:
        """The block of dst that holds the page of src's block_id already, or None."""
        block_hash = src.pool.block_hash(block_id)
        if block_hash is not None:
            found = dst.pool.lookup(block_hash)
            if found is not None:
                return found
        return src.peers.get(block_id)

    def _move(self, seq_id: int, src: _Tier, dst: _Tier) -> list[tuple[int, int]]:
        """Move seq_id's table from src to dst (the room checked): the pages dst holds already
        are shared, first (so that no block taken for a copy evicts one of them); the others
        are copied into new blocks, recorded under their hash or as peers. Returns the
        (src, dst) pairs to copy."""
        table = src.tables.pop(seq_id, [])
        moved = [self._find_on(dst, src, block_id) for block_id in table]
        for block_id in moved:
            if block_id is not None:
                dst.pool.touch(block_id)
        num_full = self._num_slots.get(seq_id, 0) // self.block_size
        pairs = []
        for i, block_id in enumerate(table):
            if moved[i] is None:
                moved[i] = copy = dst.pool.allocate()
                pairs.append((block_id, copy))
                self._record_copy(src, block_id, dst, copy, i < num_full)
        self._release(src, dst, table)
        dst.tables[seq_id] = moved
        return pairs

    @staticmethod
    def _record_copy(src: _Tier, block_id: int, dst: _Tier, copy: int, full: bool) -> None:
        """dst's block `copy` is to hold the page of src's block_id: under the page's hash, or,
        for a full unhashed page that another seq keeps on src, as its peer there."""
        block_hash = src.pool.block_hash(block_id)
        if block_hash is not None:
            dst.pool.cache(copy, block_hash)
        elif full and src.pool.ref_count(block_id) > 1:
            src.peers[block_id] = copy
            dst.peers[copy] = block_id

    @staticmethod
    def _release(tier: _Tier, other: _Tier, table: Sequence[int]) -> None:
        """Drop one reference to each block of table, last page first (the free queue evicts
        from its head: a prefix outlives its continuations); a block freed loses its peer."""
        pool, peers = tier.pool, tier.peers
        for block_id in reversed(table):
            if not pool.free(block_id) and peers:
                peer = peers.pop(block_id, None)
                if peer is not None:
                    del other.peers[peer]

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references on both devices (no-op if it has none)."""
        self._release(self._gpu, self._cpu, self._gpu.tables.pop(seq_id, ()))
        self._release(self._cpu, self._gpu, self._cpu.tables.pop(seq_id, ()))
        self._num_slots.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._num_cached_blocks.pop(seq_id, None)

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """AssertionError unless, on each device: every block is free xor mapped, ref counts
        equal table references, free + used == capacity, hash maps agree; a block is at the
        same page index in every table that holds it, full there if it is shared, and under
        that seq's hash of the page if it has a hash; peers pair referenced blocks of full pages
        both ways, at the same page index; no seq is on both devices."""
        both = set(self._gpu.tables) & set(self._cpu.tables)
        assert not both, f"seqs mapped on GPU and CPU at once: {sorted(both)}"
        pages = {}
        for name, tier, other in (("gpu", self._gpu, self._cpu), ("cpu", self._cpu, self._gpu)):
            refs = Counter(b for table in tier.tables.values() for b in table)
            tier.pool.check_invariants(dict(refs), name)
            pages[name] = self._check_tables(name, tier)
            for block_id, peer in tier.peers.items():
                assert other.peers.get(peer) == block_id, f"{name}: peers of {block_id} disagree"
                assert tier.pool.ref_count(block_id) and other.pool.ref_count(peer), \
                    f"{name}: block {block_id} or its peer {peer} is free"
        for block_id, peer in self._gpu.peers.items():
            assert pages["gpu"].get(block_id) == pages["cpu"].get(peer) is not None, \
                f"gpu block {block_id} and its peer {peer} hold different pages"
        for seq_id, table in self._gpu.tables.items():
            need = self.num_blocks_needed(self._num_slots.get(seq_id, 0))
            assert len(table) >= need, f"seq {seq_id}: table of {len(table)} blocks, needs {need}"
        for seq_id, num_cached in self._num_cached_blocks.items():
            assert num_cached <= len(self._gpu.tables.get(seq_id, ())), f"seq {seq_id}: cached"

    def _check_tables(self, name: str, tier: _Tier) -> dict[int, int]:
        """The page index of each block the tables of tier hold (checked to be one)."""
        page_of: dict[int, int] = {}
        for seq_id, table in tier.tables.items():
            chain = self._hashes.get(seq_id, ())
            num_full = self._num_slots.get(seq_id, 0) // self.block_size
            for i, block_id in enumerate(table):
                assert page_of.setdefault(block_id, i) == i, \
                    f"{name}: block {block_id} is page {page_of[block_id]} and page {i}"
                shared = tier.pool.ref_count(block_id) > 1 or block_id in tier.peers
                assert not shared or i < num_full, f"{name}: seq {seq_id} shares partial page {i}"
                block_hash = tier.pool.block_hash(block_id)
                assert block_hash is None or i >= len(chain) or block_hash == chain[i], \
                    f"{name}: seq {seq_id} page {i} is in a block of another page's hash"
        return page_of
