"""BlockTables: the InputBatch's block-table rows, appended to and gathered per step."""
import numpy as np
import pytest

from executor_svc.block_tables import BlockTables


def test_rows_hold_their_tables_through_appends_resets_and_growth():
    tables = BlockTables(max_blocks_per_seq=8, rows=2)
    tables.set(0, [5, 6])
    tables.set(1, [7])
    tables.grow(4)
    tables.set(2, [1, 2, 3])
    tables.append(0, [9])
    assert [tables.table(r) for r in (0, 1, 2)] == [[5, 6, 9], [7], [1, 2, 3]]
    tables.set(1, [4])  # the row given to another seq: its stale columns are not its table
    assert tables.table(1) == [4]
    gathered = tables.gather(np.array([2, 0, 1]))
    assert gathered.shape == (3, 3) and gathered.dtype == np.int32
    assert [row[:n].tolist() for row, n in zip(gathered, (3, 3, 1))] == [[1, 2, 3], [5, 6, 9], [4]]


def test_a_table_longer_than_the_width_is_refused():
    tables = BlockTables(max_blocks_per_seq=2, rows=1)
    tables.set(0, [1, 2])
    with pytest.raises(ValueError, match="exceeds 2"):
        tables.append(0, [3])
    assert tables.table(0) == [1, 2]


def test_append_many_appends_each_rows_ids_in_one_scatter():
    tables = BlockTables(max_blocks_per_seq=4, rows=4)
    a, b, c = 0, 1, 2
    tables.set(a, [1])
    tables.set(b, [2, 3])
    tables.set(c, [])
    tables.append_many(np.array([c, a, b]), np.array([2, 0, 1]), np.array([7, 8, 9]))
    assert [tables.table(r) for r in (a, b, c)] == [[1], [2, 3, 9], [7, 8]]
    with pytest.raises(ValueError):
        tables.append_many(np.array([b]), np.array([2]), np.array([4, 5]))
