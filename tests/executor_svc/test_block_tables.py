"""BlockTables: rows that persist across steps, gathered per step."""
import numpy as np
import pytest

from executor_svc.block_tables import BlockTables


def test_rows_hold_their_tables_through_appends_frees_and_growth():
    tables = BlockTables(max_blocks_per_seq=8, rows=2)
    a = tables.add([5, 6])
    b = tables.add([7])
    c = tables.add([1, 2, 3])  # a third row: the array doubles
    tables.append(a, [9])
    assert [tables.table(r) for r in (a, b, c)] == [[5, 6, 9], [7], [1, 2, 3]]
    assert tables.num_blocks(a) == 3
    tables.free(b)
    d = tables.add([4])  # reuses b's row; its stale columns are not part of its table
    assert d == b and tables.table(d) == [4]
    gathered = tables.gather(np.array([c, a, d]))
    assert gathered.shape == (3, 3) and gathered.dtype == np.int32
    assert [row[:n].tolist() for row, n in zip(gathered, (3, 3, 1))] == [[1, 2, 3], [5, 6, 9], [4]]


def test_a_table_longer_than_the_width_is_refused():
    tables = BlockTables(max_blocks_per_seq=2)
    row = tables.add([1, 2])
    with pytest.raises(ValueError, match="exceeds 2"):
        tables.append(row, [3])
    assert tables.table(row) == [1, 2]


def test_clear_frees_every_row():
    tables = BlockTables(max_blocks_per_seq=4, rows=2)
    tables.add([1])
    tables.add([2])
    tables.clear()
    assert sorted(tables.add([3]) for _ in range(2)) == [0, 1]


def test_append_many_appends_each_rows_ids_in_one_scatter():
    tables = BlockTables(max_blocks_per_seq=4, rows=4)
    a, b, c = tables.add([1]), tables.add([2, 3]), tables.add([])
    tables.append_many(np.array([c, a, b]), np.array([2, 0, 1]), np.array([7, 8, 9]))
    assert [tables.table(r) for r in (a, b, c)] == [[1], [2, 3, 9], [7, 8]]
    with pytest.raises(ValueError):
        tables.append_many(np.array([b]), np.array([2]), np.array([4, 5]))
