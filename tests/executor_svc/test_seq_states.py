"""SeqStates and RowIndex: per-seq rows that persist across steps; a finished step's tokens land
only in rows still held by the seqs that sampled them."""
import numpy as np

from executor_svc.seq_states import RowIndex, SeqStates


def test_row_index_finds_held_seqs_and_nothing_else():
    index = RowIndex()
    assert index.rows(np.array([3], dtype=np.uint64)).tolist() == [-1]
    for seq_id, row in ((9, 0), (2**64 - 1, 1), (4, 2), (7, 3)):
        index.add(seq_id, row)
    index.remove(4)
    query = np.array([7, 4, 2**64 - 1, 9, 0, 10], dtype=np.uint64)
    assert index.rows(query).tolist() == [3, -1, 1, 0, -1, -1]


def test_sampled_tokens_land_in_rows_of_the_same_registration():
    states = SeqStates(max_model_len=8, rows=1)
    states.add(0, [5, 6], 0, greedy=True)
    states.add(1, [7], 0, greedy=True)  # a second row: the arrays grow
    old = states.generation[[0, 1]].copy()
    states.add(1, [8, 9, 10], 0, greedy=False)  # row 1 is given to another seq
    states.record_sampled(np.array([0, 1]), old, np.array([2, 1]), np.array([11, 12]))
    assert states.tokens(0).tolist() == [5, 6, 11] and states.tokens(1).tolist() == [8, 9, 10]
    rows, positions = states.input_positions(np.array([1, 0]), np.array([2, 1]))
    assert rows.tolist() == [1, 1, 0] and positions.tolist() == [0, 1, 0]
