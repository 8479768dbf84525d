"""The page tables: which physical GPU (or CPU, when swapped) block holds each logical page of
each sequence, and the prefix cache of full pages. The only owner of page tables and of both block
pools. Plain Python only."""

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence

from scheduler_svc.block_pool import BlockPool


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full page: SHA-256 over its predecessor's hash and its token ids, so that
    equal hashes mean equal prefixes (a cryptographic hash: one tenant cannot forge another's
    page). The first page's parent is the salt (the model fingerprint)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


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
    way, so a shared page is never written and needs no copy. Swapping a seq out copies every
    page of its table to the CPU and drops its references: a page another seq shares stays on
    the GPU, held by that seq, and a cached page keeps its hash in the free queue.
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
        """Forget every mapping and free every block (used when the executor is lost)."""
        self._gpu_pool = BlockPool(self.num_gpu_blocks)
        self._cpu_pool = BlockPool(self.num_cpu_blocks)
        self._gpu_tables: dict[int, list[int]] = {}
        self._cpu_tables: dict[int, list[int]] = {}
        # Tokens the table was last asked to cover: tells whether the last block is partial.
        self._num_slots: dict[int, int] = {}
        # Prefix caching: each seq's chain of full-page hashes (from its tokens), and how many
        # blocks at the start of its GPU table cache_full_blocks has seen.
        self._hashes: dict[int, list[bytes]] = {}
        self._num_cached_blocks: dict[int, int] = {}

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_free_gpu_blocks(self) -> int:
        return self._gpu_pool.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu_pool.num_free

    @property
    def num_used_gpu_blocks(self) -> int:
        return self._gpu_pool.num_used

    @property
    def gpu_usage(self) -> float:
        """Fraction of GPU blocks in use, in [0, 1]."""
        return self._gpu_pool.num_used / self.num_gpu_blocks if self.num_gpu_blocks else 0.0

    @property
    def num_cached_gpu_blocks(self) -> int:
        """GPU pages held in the prefix cache, referenced or free."""
        return self._gpu_pool.num_cached

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, seq_id: int) -> list[int]:
        """A copy of the GPU block table (empty if the sequence has none)."""
        return list(self._gpu_tables.get(seq_id, ()))

    def get_cpu_block_table(self, seq_id: int) -> list[int]:
        return list(self._cpu_tables.get(seq_id, ()))

    # ---- growth --------------------------------------------------------------------------------

    def _num_new_blocks(self, seq_id: int, num_total_tokens: int) -> int:
        have = len(self._gpu_tables.get(seq_id, ()))
        return max(0, self.num_blocks_needed(num_total_tokens) - have)

    def can_allocate_slots(self, seq_id: int, num_total_tokens: int) -> bool:
        return self._gpu_pool.can_allocate(self._num_new_blocks(seq_id, num_total_tokens))

    def append_slots(self, seq_id: int, num_total_tokens: int) -> Sequence[int] | None:
        """allocate_slots for a seq that has a GPU table, at a fraction of its cost (the
        scheduler calls it for every decode of every step): the block ids appended, or None,
        and no change, when the pool is short. No new block is a shared empty tuple: nothing
        to allocate on the common path. No write ever lands in a shared page (only full pages
        are shared), so no copy-on-write is looked for."""
        table = self._gpu_tables.get(seq_id)
        if table is None:
            return None
        num_slots = self._num_slots.get(seq_id, 0)
        if num_total_tokens <= num_slots:
            return ()
        pool = self._gpu_pool
        num_new_blocks = -(-num_total_tokens // self.block_size) - len(table)
        new_block_ids: Sequence[int] = ()
        if num_new_blocks > 0:
            if not pool.can_allocate(num_new_blocks):
                return None
            new_block_ids = pool.allocate_n(num_new_blocks)
            table.extend(new_block_ids)
        self._num_slots[seq_id] = num_total_tokens
        return new_block_ids

    def allocate_slots(self, seq_id: int, num_total_tokens: int,
                       cached_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Grow the GPU table of `seq_id` so it covers `num_total_tokens` tokens.

        Returns the block ids appended to the table, or None (and no change) when the GPU pool
        is short. `cached_block_ids` (from find_cached_prefix, for a seq without a table) start
        the table: they hold its first pages' KV already.
        """
        if cached_block_ids:
            if not self._take_cached_prefix(seq_id, cached_block_ids, num_total_tokens):
                return None
        elif not self.can_allocate_slots(seq_id, num_total_tokens):
            return None
        if seq_id in self._cpu_tables:
            raise RuntimeError(f"seq {seq_id} is swapped out; swap it in first")
        table = self._gpu_tables.setdefault(seq_id, [])
        new_block_ids = self._gpu_pool.allocate_n(self._num_new_blocks(seq_id, num_total_tokens))
        table.extend(new_block_ids)
        self._num_slots[seq_id] = max(self._num_slots.get(seq_id, 0), num_total_tokens)
        return new_block_ids

    def _take_cached_prefix(self, seq_id: int, block_ids: Sequence[int],
                            num_total_tokens: int) -> bool:
        """Start seq_id's table with cached blocks if they and the rest of num_total_tokens fit
        (a cached block in the free queue counts against the free blocks); else no change."""
        if seq_id in self._gpu_tables or seq_id in self._cpu_tables:
            raise RuntimeError(f"seq {seq_id} already has blocks; a cached prefix starts a table")
        pool = self._gpu_pool
        num_free_hits = sum(1 for block_id in block_ids if pool.ref_count(block_id) == 0)
        num_new = max(0, self.num_blocks_needed(num_total_tokens) - len(block_ids))
        if not pool.can_allocate(num_new + num_free_hits):
            return False
        for block_id in block_ids:
            pool.touch(block_id)
        self._gpu_tables[seq_id] = list(block_ids)
        self._num_slots[seq_id] = len(block_ids) * self.block_size
        self._num_cached_blocks[seq_id] = len(block_ids)
        return True

    # ---- prefix caching ----------------------------------------------------------------------

    def _hash_chain(self, seq_id: int, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        """seq_id's full-page hashes, extended to at least num_blocks (tokens only grow)."""
        chain = self._hashes.setdefault(seq_id, [])
        size = self.block_size
        while len(chain) < num_blocks:
            i = len(chain)
            chain.append(hash_block(chain[-1] if chain else self._salt,
                                    token_ids[i * size:(i + 1) * size]))
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
            block_id = self._gpu_pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def cache_full_blocks(self, seq_id: int, token_ids: Sequence[int], num_tokens: int) -> None:
        """Record the full pages among seq_id's first num_tokens tokens (their KV written by
        steps already sent, their token ids known) in the prefix cache."""
        table = self._gpu_tables.get(seq_id)
        if not self.enable_prefix_caching or table is None:
            return
        start = self._num_cached_blocks.get(seq_id, 0)
        end = min(num_tokens // self.block_size, len(table))
        if end <= start:
            return
        chain = self._hash_chain(seq_id, token_ids, end)
        for i in range(start, end):
            self._gpu_pool.cache(table[i], chain[i])
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
        if child_seq_id in self._gpu_tables or child_seq_id in self._cpu_tables:
            raise RuntimeError(f"fork: seq {child_seq_id} already has blocks")
        parent = self._gpu_tables[parent_seq_id]
        num_shared, num_partial = divmod(num_tokens - 1, self.block_size)
        if len(parent) < num_shared + int(num_partial > 0):
            raise RuntimeError(f"fork: seq {parent_seq_id} does not cover {num_tokens - 1} tokens")
        if not self._gpu_pool.can_allocate(1):
            return False
        table = parent[:num_shared]
        for block_id in table:
            self._gpu_pool.incref(block_id)
        block_id = self._gpu_pool.allocate()
        if num_partial:
            copies.append((parent[num_shared], block_id))
        table.append(block_id)
        self._gpu_tables[child_seq_id] = table
        self._num_slots[child_seq_id] = num_tokens
        self._num_cached_blocks[child_seq_id] = min(
            num_shared, self._num_cached_blocks.get(parent_seq_id, 0))
        return True

    # ---- swapping ----------------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        return self._cpu_pool.can_allocate(len(self._gpu_tables.get(seq_id, ())))

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the table to CPU blocks; returns the (gpu, cpu) pairs the executor must copy."""
        if not self.can_swap_out(seq_id):
            raise RuntimeError(f"swap_out: not enough CPU blocks for seq {seq_id}")
        gpu_table = self._gpu_tables.pop(seq_id, [])
        self._num_cached_blocks.pop(seq_id, None)  # its pages come back in other blocks
        cpu_table = self._cpu_pool.allocate_n(len(gpu_table))
        for block_id in reversed(gpu_table):
            self._gpu_pool.free(block_id)
        self._cpu_tables[seq_id] = cpu_table
        return list(zip(gpu_table, cpu_table))

    def can_swap_in(self, seq_id: int) -> bool:
        return self._gpu_pool.can_allocate(len(self._cpu_tables.get(seq_id, ())))

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the table back to GPU blocks; returns the (cpu, gpu) pairs to copy."""
        if not self.can_swap_in(seq_id):
            raise RuntimeError(f"swap_in: not enough GPU blocks for seq {seq_id}")
        cpu_table = self._cpu_tables.pop(seq_id, [])
        gpu_table = self._gpu_pool.allocate_n(len(cpu_table))
        for block_id in cpu_table:
            self._cpu_pool.free(block_id)
        self._gpu_tables[seq_id] = gpu_table
        return list(zip(cpu_table, gpu_table))

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references on both devices (no-op if it has none). Last page
        first: the free queue evicts from its head, and a prefix outlives its continuations."""
        for block_id in reversed(self._gpu_tables.pop(seq_id, ())):
            self._gpu_pool.free(block_id)
        for block_id in self._cpu_tables.pop(seq_id, ()):
            self._cpu_pool.free(block_id)
        self._num_slots.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._num_cached_blocks.pop(seq_id, None)

    # ---- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """AssertionError unless: every block is free xor mapped, ref counts equal table
        references, free + used == capacity per pool, and no seq is on both devices."""
        both = set(self._gpu_tables) & set(self._cpu_tables)
        assert not both, f"seqs mapped on GPU and CPU at once: {sorted(both)}"
        for name, pool, tables in (("gpu", self._gpu_pool, self._gpu_tables),
                                   ("cpu", self._cpu_pool, self._cpu_tables)):
            refs = Counter(b for table in tables.values() for b in table)
            pool.check_invariants(dict(refs), name)
        for seq_id, table in self._gpu_tables.items():
            need = self.num_blocks_needed(self._num_slots.get(seq_id, 0))
            assert len(table) >= need, f"seq {seq_id}: table of {len(table)} blocks, needs {need}"
        for seq_id, num_cached in self._num_cached_blocks.items():
            assert num_cached <= len(self._gpu_tables.get(seq_id, ())), f"seq {seq_id}: cached"
