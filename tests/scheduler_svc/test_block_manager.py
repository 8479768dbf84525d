"""BlockManager: growth, swap round trips, prefix caching, invariants (fork_prompt: in
test_parallel_sampling.py)."""

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
    assert not bm.can_allocate_slots(1, 13)
    assert bm.allocate_slots(1, 13) is None
    assert bm.get_block_table(1) == [0] and bm.num_free_gpu_blocks == 1
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
    bm._gpu_tables[2] = [bm.get_block_table(1)[0]]  # a second table reference, no incref
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
    assert pairs[0][0] == shared and bm._gpu_pool.ref_count(shared) == 1  # copied, not freed
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
