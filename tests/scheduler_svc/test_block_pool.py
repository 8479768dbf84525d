"""BlockPool: FIFO free list, ref counts, all-or-nothing allocation."""

import pytest

from scheduler_svc.block_pool import BlockPool


def test_allocate_is_fifo_and_free_returns_to_tail():
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.num_free == 0 and not pool.can_allocate(1)
    pool.free(1)
    pool.free(0)
    assert pool.allocate_n(2) == [1, 0]


def test_ref_counts_keep_block_until_last_free():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.incref(block)
    assert pool.free(block) == 1 and pool.num_free == 1
    assert pool.free(block) == 0 and pool.num_free == 2


def test_allocate_n_is_all_or_nothing():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate_n(3)
    assert pool.num_free == 2


def test_misuse_raises():
    pool = BlockPool(1)
    with pytest.raises(RuntimeError):
        pool.free(0)
    with pytest.raises(RuntimeError):
        pool.incref(0)
    pool.allocate()
    with pytest.raises(RuntimeError):
        pool.allocate()


def test_invariants_detect_mismatch():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.check_invariants({block: 1}, "gpu")
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_invariants({}, "gpu")


def test_a_cached_free_block_keeps_its_hash_until_allocated_from_the_head():
    pool = BlockPool(3)
    a, b = pool.allocate_n(2)
    assert pool.cache(a, b"ha") and pool.cache(b, b"hb")
    c = pool.allocate()
    assert not pool.cache(a, b"other") and not pool.cache(c, b"ha")  # no doubles
    pool.free(c), pool.free(a), pool.free(b)  # free queue: c, a, b
    assert pool.lookup(b"ha") == a and pool.num_cached == 2
    pool.touch(b)  # a hit takes b out of the middle of the queue
    assert pool.ref_count(b) == 1 and pool.num_free == 2 and pool.allocate() == c
    assert pool.allocate() == a and pool.lookup(b"ha") is None  # evicted at the head
    assert pool.num_evicted == 1 and pool.lookup(b"hb") == b
