"""BlockManager: growth, swap round trips, fork with copy-on-write, invariants."""

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


def test_fork_shares_blocks_and_cow_copies_partial_last_block():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    bm.allocate_slots(1, 6)  # blocks [0, 1]; block 1 half full
    bm.fork(1, 2)
    assert bm.get_block_table(2) == [0, 1] and bm.num_free_gpu_blocks == 6
    bm.check_invariants()
    copies = []
    assert bm.allocate_slots(2, 7, copies) == []
    assert copies == [(1, 2)]
    assert bm.get_block_table(2) == [0, 2] and bm.get_block_table(1) == [0, 1]
    bm.check_invariants()
    more = []
    assert bm.allocate_slots(1, 7, more) == [] and more == []  # block 1 is private again
    bm.free(1)
    bm.free(2)
    assert bm.num_free_gpu_blocks == 8
    bm.check_invariants()


def test_fork_full_last_block_needs_no_copy():
    bm = BlockManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0)
    bm.allocate_slots(1, 8)
    bm.fork(1, 2)
    copies = []
    assert bm.allocate_slots(2, 9, copies) == [2] and copies == []
    bm.check_invariants()


def test_cow_counts_toward_capacity_and_requires_copy_list():
    bm = BlockManager(block_size=4, num_gpu_blocks=3, num_cpu_blocks=0)
    bm.allocate_slots(1, 6)
    bm.fork(1, 2)
    with pytest.raises(RuntimeError, match="copy-on-write"):
        bm.allocate_slots(2, 7)
    bm.allocate_slots(3, 1)
    assert not bm.can_allocate_slots(2, 7)  # pool full: the copy has nowhere to go
    assert bm.allocate_slots(2, 7, []) is None
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
