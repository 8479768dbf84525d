"""BlockManager: growth, swap round trips, prefix caching, invariants (fork_prompt: in
test_parallel_sampling.py)."""

import itertools
import random

import pytest

from scheduler_svc.block_manager import BlockManager


def test_allocate_slots_appends_only_new_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4)
    assert bm.num_blocks_needed(0) == 0 and bm.num_blocks_needed(5) == 2
    assert bm.allocate_slots(1, 5) == [0, 1]
    assert bm.allocate_slots(1, 8) == []
    assert bm.allocate_slots(1, 9) == [2]
    assert bm.get_block_table(1) == [0, 1, 2]
    bm.check_invariants()


def test_allocate_slots_short_pool_changes_nothing():
    bm = BlockManager(block_size=4, num_gpu_blocks=2, num_cpu_blocks=0)
    bm.allocate_slots(1, 4)
    assert bm.allocate_slots(1, 13) is None
    assert bm.allocate_slots(2, 9) is None  # a seq without a table gets none
    assert bm.get_block_table(1) == [0] and bm.num_free_gpu_blocks == 1
    assert bm.get_block_table(2) == [] and bm.allocate_slots(2, 4) == [1]
    bm.check_invariants()


def test_swap_round_trip_moves_every_block():
    bm = BlockManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=4)
    bm.allocate_slots(7, 5)
    gpu_table = bm.get_block_table(7)
    assert bm.can_swap_out(7)
    out = bm.swap_out(7)
    assert [g for g, _ in out] == gpu_table
    assert bm.get_block_table(7) == [] and bm.num_free_gpu_blocks == 4
    assert bm.get_cpu_block_table(7) == [c for _, c in out]
    bm.check_invariants()
    assert bm.can_swap_in(7)
    back = bm.swap_in(7)
    assert [c for c, _ in back] == [c for _, c in out]
    assert bm.get_block_table(7) == [g for _, g in back]
    assert bm.num_free_cpu_blocks == 4
    bm.check_invariants()
    assert bm.allocate_slots(7, 6) == []  # slot count survives the round trip


def test_swap_out_needs_cpu_room():
    bm = BlockManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=1)
    bm.allocate_slots(1, 3)
    assert not bm.can_swap_out(1)
    with pytest.raises(RuntimeError):
        bm.swap_out(1)
    bm.check_invariants()


def test_free_and_reset_release_both_devices():
    bm = BlockManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=4)
    bm.allocate_slots(1, 3)
    bm.allocate_slots(2, 3)
    bm.swap_out(2)
    bm.free(2)
    assert bm.num_free_cpu_blocks == 4
    bm.reset()
    assert bm.num_free_gpu_blocks == 4 and bm.get_block_table(1) == []
    assert bm.gpu_usage == 0.0
    bm.check_invariants()


def test_invariants_catch_corruption():
    bm = BlockManager(block_size=2, num_gpu_blocks=4, num_cpu_blocks=0)
    bm.allocate_slots(1, 3)
    bm._gpu.tables[2] = [bm.get_block_table(1)[0]]  # a second table reference, no incref
    with pytest.raises(AssertionError, match="ref count"):
        bm.check_invariants()


# ---- prefix caching ------------------------------------------------------------------------

def _caching_bm(num_gpu_blocks=8, num_cpu_blocks=4, salt="model-a"):
    return BlockManager(block_size=4, num_gpu_blocks=num_gpu_blocks,
                        num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=True,
                        cache_salt=salt)


def test_hashes_chain_over_the_parent_and_the_salt():
    from scheduler_svc.block_manager import hash_block
    a, b = hash_block(b"p", [1, 2, 3, 4]), hash_block(b"q", [1, 2, 3, 4])
    assert a != b and a == hash_block(b"p", [1, 2, 3, 4])
    bm1, bm2 = _caching_bm(salt="model-a"), _caching_bm(salt="model-b")
    for bm in (bm1, bm2):
        bm.allocate_slots(1, 8)
        bm.cache_full_blocks(1, list(range(8)), 8)
    tokens = list(range(8)) + [99]
    assert bm1.find_cached_prefix(2, tokens) == bm1.get_block_table(1)
    other = _caching_bm(salt="model-b")
    assert other.find_cached_prefix(2, tokens) == []  # another fingerprint: nothing shared
    # The same second page after a different first page is another page.
    assert bm1.find_cached_prefix(3, [7, 7, 7, 7, 4, 5, 6, 7, 99]) == []


def test_a_hit_is_full_pages_of_at_most_all_but_the_last_token():
    bm = _caching_bm()
    bm.allocate_slots(1, 10)
    bm.cache_full_blocks(1, list(range(10)), 10)  # two full pages, the third partial
    table = bm.get_block_table(1)
    assert bm.num_cached_gpu_blocks == 2
    assert bm.find_cached_prefix(2, list(range(10))) == table[:2]
    assert bm.find_cached_prefix(3, list(range(8))) == table[:1]  # 8 tokens: at most 7 cached
    assert bm.find_cached_prefix(4, list(range(9))) == table[:2]
    assert bm.find_cached_prefix(5, [0, 1, 2, 3, 4, 5, 6, 0, 1]) == table[:1]  # miss in page 2


def test_a_hit_shares_pages_by_ref_count_and_they_outlive_their_seqs_until_evicted():
    bm = _caching_bm(num_gpu_blocks=4)
    bm.allocate_slots(1, 8)
    bm.cache_full_blocks(1, list(range(8)), 8)
    hit = bm.find_cached_prefix(2, list(range(8)) + [50, 51])
    assert bm.allocate_slots(2, 10, cached_block_ids=hit) == [2]  # one new page after the hit
    assert bm.get_block_table(2)[:2] == bm.get_block_table(1) and bm.num_free_gpu_blocks == 1
    bm.check_invariants()
    bm.free(1), bm.free(2)
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == 4 and bm.num_cached_gpu_blocks == 2  # whole, still cached
    hit = bm.find_cached_prefix(3, list(range(8)) + [60])
    assert bm.allocate_slots(3, 9, cached_block_ids=hit) is not None  # a hit on free pages
    assert bm.get_block_table(3)[:2] == hit
    bm.free(3)
    bm.allocate_slots(4, 16)  # the whole pool: every cached page is evicted
    assert bm.num_cached_gpu_blocks == 0 and bm.find_cached_prefix(5, list(range(9))) == []
    bm.free(4)
    bm.check_invariants()


def test_eviction_is_lru_and_a_prefix_outlives_its_continuation():
    bm = _caching_bm(num_gpu_blocks=5)
    bm.allocate_slots(1, 8)
    bm.cache_full_blocks(1, list(range(8)), 8)
    first, second = bm.get_block_table(1)
    bm.free(1)  # last page first: the free queue ends ..., second, first
    bm.allocate_slots(2, 16)  # the 3 never-used blocks, then the least recent: second
    assert second in bm.get_block_table(2) and first not in bm.get_block_table(2)
    assert bm.find_cached_prefix(3, list(range(9))) == [first]
    bm.free(2)
    bm.check_invariants()


def test_a_hit_that_does_not_fit_changes_nothing():
    bm = _caching_bm(num_gpu_blocks=3)
    bm.allocate_slots(1, 4)
    bm.cache_full_blocks(1, [1, 2, 3, 4], 4)
    bm.free(1)
    hit = bm.find_cached_prefix(2, [1, 2, 3, 4] + [0] * 9)
    assert bm.allocate_slots(2, 13, cached_block_ids=hit) is None  # needs 4 pages of 3
    assert bm.get_block_table(2) == [] and bm.num_free_gpu_blocks == 3
    bm.check_invariants()


def test_swapping_out_a_seq_that_shares_a_cached_page_leaves_it_to_the_other_seq():
    bm = _caching_bm(num_gpu_blocks=6, num_cpu_blocks=4)
    bm.allocate_slots(1, 6)
    bm.cache_full_blocks(1, list(range(6)), 6)
    hit = bm.find_cached_prefix(2, list(range(4)) + [9, 9])
    bm.allocate_slots(2, 6, cached_block_ids=hit)
    shared = hit[0]
    pairs = bm.swap_out(2)
    assert pairs[0][0] == shared and bm._gpu.pool.ref_count(shared) == 1  # copied, not freed
    assert bm.get_block_table(1)[0] == shared
    bm.check_invariants()
    bm.swap_in(2)
    bm.cache_full_blocks(2, list(range(4)) + [9, 9], 6)  # same page elsewhere: not a duplicate
    assert bm.num_cached_gpu_blocks == 1
    bm.free(1), bm.free(2)
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == 6 and bm.num_free_cpu_blocks == 4


def test_reset_drops_every_hash():
    bm = _caching_bm()
    bm.allocate_slots(1, 8)
    bm.cache_full_blocks(1, list(range(8)), 8)
    bm.reset()
    assert bm.num_cached_gpu_blocks == 0 and bm.find_cached_prefix(2, list(range(9))) == []


def test_caching_off_finds_nothing():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    bm.allocate_slots(1, 8)
    bm.cache_full_blocks(1, list(range(8)), 8)
    assert bm.num_cached_gpu_blocks == 0 and bm.find_cached_prefix(2, list(range(9))) == []


# ---- swapping shared pages (issue 12) ---------------------------------------------------------
# Three seqs share two full pages of a prompt: by prefix caching (hashes), or by fork_prompt with
# caching off (no hashes: peers). `Kv` plays the executor: it moves what each block holds by the
# pairs the block manager returns, so a table naming a block of another page shows up at once.

SHARED = list(range(100, 108))  # two full pages of 4


def tokens_of(seq_id):
    return SHARED + [seq_id * 10 + i for i in range(5)]  # page 2 the seq's own, page 3 partial


class Kv:
    """What each block holds ("KV": the tokens of the page and of every page before it), moved
    by the pairs the block manager returns; counts the pages copied each way."""

    def __init__(self, bm):
        self.bm, self.gpu, self.cpu = bm, {}, {}
        self.copies = {"out": [], "in": []}  # the pages each direction copied

    def write(self, seq_id):
        for i, block_id in enumerate(self.bm.get_block_table(seq_id)):
            self.gpu[block_id] = self.page(seq_id, i)

    @staticmethod
    def page(seq_id, i):
        return tuple(tokens_of(seq_id)[:(i + 1) * 4])  # as real KV: the whole prefix counts

    def swap(self, direction, seq_id):
        """bm.swap_out ("out") or bm.swap_in ("in"), its pairs copied here and counted."""
        out = direction == "out"
        src, dst = (self.gpu, self.cpu) if out else (self.cpu, self.gpu)
        pairs = (self.bm.swap_out if out else self.bm.swap_in)(seq_id)
        for src_block, dst_block in pairs:
            dst[dst_block] = src[src_block]
            self.copies[direction].append(src[src_block])
        self.check()
        return pairs

    def check(self):
        """Invariants; every table names blocks holding its seq's pages; no device holds a
        shared page in two blocks."""
        self.bm.check_invariants()
        for seq_id in range(1, 4):
            gpu, cpu = self.bm.get_block_table(seq_id), self.bm.get_cpu_block_table(seq_id)
            held = [self.gpu[b] for b in gpu] or [self.cpu[b] for b in cpu]
            assert held == [self.page(seq_id, i) for i in range(len(held))], seq_id
        for tables in (self.bm.get_block_table, self.bm.get_cpu_block_table):
            prefixes = {tuple(tables(s)[:2]) for s in range(1, 4)} - {()}
            assert len(prefixes) <= 1, prefixes

    def shared_copies(self, direction):
        """The indexes of the shared pages copied in that direction, each time it was."""
        return sorted(len(p) // 4 - 1 for p in self.copies[direction]
                      if len(p) <= len(SHARED) and p == tuple(SHARED[:len(p)]))


def three_sharing_seqs(caching, num_gpu_blocks=16, num_cpu_blocks=16):
    """Seqs 1, 2, 3 with tokens_of(seq_id) (13 tokens: 4 pages), the first two pages shared."""
    bm = BlockManager(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                      enable_prefix_caching=caching, cache_salt="m")
    kv = Kv(bm)
    bm.allocate_slots(1, 13)
    kv.write(1)
    bm.cache_full_blocks(1, tokens_of(1), 13)
    for seq_id in (2, 3):
        if caching:
            hit = bm.find_cached_prefix(seq_id, tokens_of(seq_id))
            assert hit == bm.get_block_table(1)[:2]
            assert bm.allocate_slots(seq_id, 13, cached_block_ids=hit) is not None
        else:
            assert bm.fork_prompt(1, seq_id, 9, [])  # the shared pages and page 2's block
            assert bm.allocate_slots(seq_id, 13) is not None
        kv.write(seq_id)
        bm.cache_full_blocks(seq_id, tokens_of(seq_id), 13)
    shared = bm.get_block_table(1)[:2]
    assert all(bm.get_block_table(s)[:2] == shared for s in (2, 3))
    kv.check()
    return bm, kv


def assert_whole(bm, free=()):
    """After freeing the seqs of `free`: both pools whole."""
    for seq_id in free:
        bm.free(seq_id)
    bm.check_invariants()
    assert bm.num_free_gpu_blocks == bm.num_gpu_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_a_shared_page_is_copied_once_each_way_in_every_order(caching):
    for out_order in itertools.permutations((1, 2, 3)):
        for in_order in itertools.permutations((1, 2, 3)):
            bm, kv = three_sharing_seqs(caching)
            for seq_id in out_order:
                kv.swap("out", seq_id)
            assert kv.shared_copies("out") == [0, 1]  # each shared page once
            assert len(kv.copies["out"]) == 2 + 3 * 2  # and each seq's own two pages
            bm.allocate_slots(9, 64)  # the whole GPU pool: no page stays cached there
            bm.free(9)
            for seq_id in in_order:
                kv.swap("in", seq_id)
            assert kv.shared_copies("in") == [0, 1] and len(kv.copies["in"]) == 8
            assert_whole(bm, free=(1, 2, 3))
            # the shared two and each seq's full page 2, cached free
            assert bm.num_cached_cpu_blocks == (2 + 3 if caching else 0)


@pytest.mark.parametrize("caching", [True, False])
def test_swaps_interleaved_in_every_order_keep_one_block_per_page_and_device(caching):
    """Each seq out, then in, the six moves interleaved in all 90 orders. With caching on the
    CPU keeps its copies of the shared pages cached, so they are copied out once, whatever the
    order, and never back (the GPU keeps them too)."""
    moves = [(kind, seq_id) for seq_id in (1, 2, 3) for kind in ("out", "in")]
    orders = {order for order in itertools.permutations(moves)
              if all(order.index(("out", s)) < order.index(("in", s)) for s in (1, 2, 3))}
    assert len(orders) == 90
    for order in sorted(orders):
        bm, kv = three_sharing_seqs(caching)
        for kind, seq_id in order:
            kv.swap(kind, seq_id)
        if caching:
            assert kv.shared_copies("out") == [0, 1] and kv.shared_copies("in") == []
        assert_whole(bm, free=(1, 2, 3))


@pytest.mark.parametrize("caching", [True, False])
def test_a_swap_in_takes_the_shared_pages_another_seq_holds_on_the_gpu(caching):
    bm, kv = three_sharing_seqs(caching)
    shared = bm.get_block_table(1)[:2]
    kv.swap("out", 3)
    assert kv.shared_copies("out") == [0, 1]  # the CPU held neither yet
    kv.swap("out", 2)
    assert kv.shared_copies("out") == [0, 1]  # found on the CPU: shared, not copied
    assert kv.copies["in"] == []
    kv.swap("in", 2)
    kv.swap("in", 3)
    assert kv.shared_copies("in") == []  # both took seq 1's blocks
    assert bm.get_block_table(2)[:2] == bm.get_block_table(3)[:2] == shared
    assert bm._gpu.pool.ref_count(shared[0]) == 3
    assert_whole(bm, free=(1, 2, 3))


def test_a_swap_in_takes_cached_pages_from_the_gpu_free_queue():
    bm, kv = three_sharing_seqs(caching=True)
    shared = bm.get_block_table(1)[:2]
    for seq_id in (3, 2, 1):
        kv.swap("out", seq_id)
    assert bm.num_free_gpu_blocks == 16 and bm.num_cached_gpu_blocks == 2 + 3  # free, cached
    kv.swap("in", 1)
    kv.swap("in", 2)
    # Only the partial last pages (no hash) are copied: every full page was still there.
    assert kv.copies["in"] == [kv.page(1, 3), kv.page(2, 3)]
    assert bm.get_block_table(1)[:2] == bm.get_block_table(2)[:2] == shared
    assert_whole(bm, free=(1, 2, 3))


def test_the_cpu_keeps_cached_pages_until_it_needs_the_blocks_least_recent_first():
    from scheduler_svc.block_manager import hash_block
    bm = _caching_bm(num_gpu_blocks=8, num_cpu_blocks=4)
    h0 = hash_block(bm._salt, [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    bm.allocate_slots(1, 10)  # two full pages and a partial one
    bm.cache_full_blocks(1, list(range(10)), 10)
    first = bm.swap_out(1)
    assert len(first) == 3 and bm.num_cached_cpu_blocks == 2  # the partial page has no hash
    bm.allocate_slots(9, 32)  # the whole GPU pool: the GPU loses its cached pages
    bm.free(9)
    assert len(bm.swap_in(1)) == 3
    assert bm.num_free_cpu_blocks == 4 and bm.num_cached_cpu_blocks == 2  # free, still cached
    again = bm.swap_out(1)  # the full pages are on the CPU already: only the partial is copied
    assert len(again) == 1 and bm.get_cpu_block_table(1)[:2] == [c for _, c in first[:2]]
    bm.check_invariants()
    bm.free(1)  # CPU free queue: the two blocks that held page 2, then page 1's, page 0's
    bm.allocate_slots(2, 12)
    bm.cache_full_blocks(2, [50 + i for i in range(12)], 12)
    assert len(bm.swap_out(2)) == 3  # takes the three least recently freed: page 1 evicted
    assert bm._cpu.pool.lookup(h0) == first[0][1] and bm._cpu.pool.lookup(h1) is None
    assert bm.num_cached_cpu_blocks == 1 + 3
    bm.free(2)
    assert_whole(bm)


@pytest.mark.parametrize("caching", [True, False])
def test_recompute_among_sharers_frees_no_page_another_device_still_needs(caching):
    bm, kv = three_sharing_seqs(caching)
    shared = bm.get_block_table(1)[:2]
    kv.swap("out", 3)
    bm.free(2)  # preempted by recompute
    kv.check()
    assert bm._gpu.pool.ref_count(shared[0]) == 1  # seq 1's
    bm.free(1)  # finished: the GPU blocks are free (cached, with caching on); seq 3 keeps its CPU
    # copy
    kv.check()
    assert bm._gpu.peers == {} and bm._cpu.peers == {}
    bm.allocate_slots(9, 64)  # and the GPU cache with it
    bm.free(9)
    kv.swap("in", 3)
    assert kv.shared_copies("in") == [0, 1]
    bm.free(3)
    assert_whole(bm)


@pytest.mark.parametrize("caching", [True, False])
def test_swap_room_counts_only_the_pages_a_swap_takes_blocks_for(caching):
    bm, kv = three_sharing_seqs(caching, num_cpu_blocks=6)
    kv.swap("out", 3)  # 4 CPU blocks, 2 left
    assert bm.can_swap_out(2)  # its 4 pages need 2 blocks: the shared two are on the CPU
    kv.swap("out", 2)
    assert not bm.can_swap_out(1)  # 2 blocks for its own pages, none left
    with pytest.raises(RuntimeError):
        bm.swap_out(1)
    kv.check()
    # Back in: the GPU holds 4 pages of seq 1 and 12 free blocks; seq 2 needs two of them, and
    # one more to grow by a page.
    bm.allocate_slots(9, 4 * 10)  # leaves 2 free
    assert bm.can_swap_in(2) and not bm.can_swap_in(2, 17)
    kv.swap("in", 2)
    assert_whole(bm, free=(1, 2, 3, 9))


@pytest.mark.parametrize("caching", [True, False])
def test_reset_drops_hashes_and_peers_on_both_devices(caching):
    bm, kv = three_sharing_seqs(caching)
    kv.swap("out", 3)
    # Its three full pages hashed on the CPU too, or its two shared pages paired with seq 1's.
    assert (bm.num_cached_cpu_blocks, len(bm._gpu.peers)) == ((3, 0) if caching else (0, 2))
    bm.reset()
    bm.check_invariants()
    assert bm.num_cached_gpu_blocks == bm.num_cached_cpu_blocks == 0
    assert bm._gpu.peers == bm._cpu.peers == {}
    assert_whole(bm)


def test_invariants_catch_a_shared_partial_page_and_one_sided_peers():
    bm, _ = three_sharing_seqs(caching=False)
    last = bm.get_block_table(1)[-1]  # seq 1's partial page
    bm._gpu.pool.free(bm._gpu.tables[2][-1])
    bm._gpu.tables[2][-1] = last  # seq 2 shares it, ref counted
    bm._gpu.pool.incref(last)
    with pytest.raises(AssertionError, match="shares partial page"):
        bm.check_invariants()
    bm, _ = three_sharing_seqs(caching=False)
    bm.swap_out(3)
    ((gpu, cpu), _) = bm._gpu.peers.items()
    del bm._cpu.peers[cpu]
    with pytest.raises(AssertionError, match="peers"):
        bm.check_invariants()


def test_the_hash_chain_is_hash_block_page_after_page_however_it_grows():
    """The chain packs a prompt's pages at once; it must equal hash_block applied page by page
    (the hashes that name cached pages), grown in one go or a page at a time."""
    from scheduler_svc.block_manager import hash_block
    rng = random.Random(5)
    tokens = [rng.randrange(0, 2**40) for _ in range(4 * 9 + 3)]  # nine full pages of 4, 3 over
    want, parent = [], _caching_bm()._salt
    for i in range(9):
        parent = hash_block(parent, tokens[4 * i:4 * i + 4])
        want.append(parent)
    at_once, bit_by_bit = _caching_bm(), _caching_bm()
    assert at_once._hash_chain(1, tokens, 9) == want
    for n in (0, 1, 2, 2, 5, 9):  # the seq's tokens grow; a call for fewer pages changes nothing
        assert bit_by_bit._hash_chain(1, tokens[:4 * n + 1], n) == want[:n]
    assert bit_by_bit._hash_chain(1, tokens, 3) == want
