"""InputBatch: the one owner of the executor's per-seq rows. Rows are added, removed and reused,
grow when full, and a step that finishes after its seq was dropped writes nothing into the row's
next seq."""
import numpy as np
import pytest
import torch

from executor_svc.input_batch import InputBatch, RowIndex
from executor_svc.step import SamplingOptions

GREEDY = SamplingOptions()
SAMPLED = SamplingOptions(temperature=0.8, seed=3)
PENALISED = SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25)
VOCAB = 32


def make_batch(rows: int = 4) -> InputBatch:
    return InputBatch(max_model_len=16, block_size=4, vocab_size=VOCAB,
                      device=torch.device("cpu"), rows=rows)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_a_new_seq_fills_every_column_of_its_row():
    batch = make_batch()
    row = batch.add(7, ids(5, 6), [3, 1], num_computed=2, sampling=SAMPLED, first_position=2)
    assert batch.row(7) == row and 7 in batch and len(batch) == 1 and batch.seq_ids == [7]
    # the tokens before first_position are in the KV cache already: 0 stands for them
    assert batch.tokens(row).tolist() == [0, 0, 5, 6]
    assert (batch.num_known[row], batch.num_tokens[row], batch.num_computed[row]) == (4, 4, 2)
    assert not batch.greedy[row] and batch.sampling[row] is SAMPLED
    assert batch.block_table.table(row) == [3, 1] and batch.count_row[row] is None
    assert batch.rows(np.array([7, 8], dtype=np.uint64)).tolist() == [row, -1]


def test_a_removed_seqs_row_is_given_to_the_next_seq_and_nothing_of_it_stays():
    batch = make_batch()
    a = batch.add(1, ids(1, 2, 3), [0], 0, GREEDY)
    b = batch.add(2, ids(4), [1], 0, SamplingOptions(logprobs=2))
    assert (a, b) == (0, 1) and batch.num_controlled == 1
    assert batch.remove(2) == b and batch.remove(2) is None  # a second drop: nothing held
    assert 2 not in batch and batch.num_controlled == 0 and batch.sampling[b] is None
    c = batch.add(3, ids(9, 9), [5, 6], 1, GREEDY)
    assert c == b  # the freed row, taken at once
    assert batch.tokens(c).tolist() == [9, 9] and batch.block_table.table(c) == [5, 6]
    assert batch.logprobs_asked(np.array([a, c])) == []
    assert batch.seq_ids == [1, 3] and batch.tokens(a).tolist() == [1, 2, 3]


def test_adding_a_held_seq_is_refused_and_changes_nothing():
    batch = make_batch(rows=2)
    batch.add(1, ids(1), [0], 0, GREEDY)
    with pytest.raises(ValueError, match="held already"):
        batch.add(1, ids(2), [1], 0, GREEDY)
    assert len(batch) == 1 and batch.add(2, ids(3), [2], 0, GREEDY) == 1  # no row lost


def test_a_step_finishing_after_its_seq_was_dropped_writes_nothing_into_the_reused_row():
    batch = make_batch()
    kept = batch.add(1, ids(5, 6), [0], 2, GREEDY)
    dropped = batch.add(2, ids(7), [1], 1, GREEDY)
    # a step computes one token of seq 2 and samples both: positions 2 and 1, on the device
    rows = np.array([kept, dropped])
    occupancies, positions = batch.occupancy[rows].copy(), batch.num_tokens[rows].copy()
    batch.advance(np.array([dropped]), np.array([2]), rows)
    assert batch.num_tokens[rows].tolist() == [3, 2] and batch.num_computed[rows].tolist() == [2, 2]
    assert batch.num_known[rows].tolist() == [2, 1]  # the sampled ids are not on the host yet
    batch.remove(2)
    reused = batch.add(3, ids(8, 9, 10), [2], 0, GREEDY)
    assert reused == dropped
    batch.record_sampled(rows, occupancies, positions, ids(11, 12))
    assert batch.tokens(kept).tolist() == [5, 6, 11]
    assert batch.tokens(reused).tolist() == [8, 9, 10] and batch.num_known[reused] == 3


def test_the_batch_grows_when_every_row_is_held_and_keeps_what_the_rows_hold():
    batch = make_batch(rows=1)
    for seq_id in range(1, 6):
        batch.add(seq_id, ids(*range(seq_id)), [seq_id], seq_id - 1,
                  SAMPLED if seq_id % 2 else GREEDY)
    assert batch.capacity == 8 and len(batch) == 5
    for seq_id in range(1, 6):
        row = batch.row(seq_id)
        assert batch.tokens(row).tolist() == list(range(seq_id))
        assert batch.block_table.table(row) == [seq_id]
        assert batch.num_computed[row] == seq_id - 1 and batch.greedy[row] == (seq_id % 2 == 0)
        assert batch.sampling[row] is (SAMPLED if seq_id % 2 else GREEDY)
    assert sorted(batch.row(s) for s in range(1, 6)) == [0, 1, 2, 3, 4]  # low rows first


def test_a_penalised_seq_gets_a_count_row_built_from_its_tokens_and_gives_it_back():
    batch = make_batch()
    with pytest.raises(ValueError, match="first_position must be 0"):
        batch.add(1, ids(4), [0], 1, PENALISED, first_position=1)
    assert 1 not in batch
    row = batch.add(1, ids(4, 5, 6, 6), [0], 4, PENALISED, num_prompt_tokens=2)
    count_row = batch.count_row[row]
    mask, counts = batch.token_counts.gather(torch.tensor([count_row]))
    assert torch.nonzero(mask[0]).flatten().tolist() == [4, 5]  # the prompt
    assert counts[0, 6].item() == 2 and counts[0].sum().item() == 2  # generated twice
    assert batch.count_rows_of(np.array([row])) == [count_row]
    batch.remove(1)
    row = batch.add(2, ids(1), [0], 0, PENALISED)
    assert batch.count_row[row] == count_row  # the freed count row, reused
    _, counts = batch.token_counts.gather(torch.tensor([count_row]))
    assert counts.sum().item() == 0


def test_clear_forgets_every_seq():
    batch = make_batch(rows=2)
    batch.add(1, ids(1), [0], 0, PENALISED)
    batch.add(2, ids(2), [1], 0, SamplingOptions(logit_bias=((3, 1.0),)))
    batch.clear()
    assert len(batch) == 0 and 1 not in batch and batch.num_controlled == 0
    assert batch.count_rows_of(np.array([0, 1])) is None
    assert [batch.add(s, ids(s), [s], 0, GREEDY) for s in (3, 4)] == [0, 1]


def test_input_positions_follow_each_rows_computed_tokens():
    batch = make_batch()
    batch.add(1, ids(5, 6, 7), [0], 1, GREEDY)
    batch.add(2, ids(8, 9), [1], 0, GREEDY)
    rows, positions = batch.input_positions(np.array([1, 0]), np.array([2, 1]))
    assert rows.tolist() == [1, 1, 0] and positions.tolist() == [0, 1, 1]


def test_row_index_finds_held_seqs_and_nothing_else():
    index = RowIndex()
    assert index.rows(np.array([3], dtype=np.uint64)).tolist() == [-1]
    for seq_id, row in ((9, 0), (2**64 - 1, 1), (4, 2), (7, 3)):
        index.add(seq_id, row)
    assert index.remove(4) == 2 and index.remove(4) is None
    query = np.array([7, 4, 2**64 - 1, 9, 0, 10], dtype=np.uint64)
    assert index.rows(query).tolist() == [3, -1, 1, 0, -1, -1]
