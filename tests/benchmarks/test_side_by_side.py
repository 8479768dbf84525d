"""side_by_side's floor model: W4 counts only what a perfect prefix cache would leave to compute."""
from __future__ import annotations

import side_by_side
from conversations import ConversationsSpec, turn_lengths


def test_w4_sizes_compute_each_token_once():
    spec = ConversationsSpec()
    sizes = side_by_side.request_sizes("W4")
    lengths = [turn for row in turn_lengths(spec, side_by_side.VOCAB) for turn in row]
    assert len(sizes) == len(lengths) == 512
    assert [(c + p, o) for c, p, o in sizes] == lengths
    # Computed: the system prompt once, every turn's new tokens, and the last output token of
    # each turn that another follows (sampled, never fed back).
    computed = sum(p for _, p, _ in sizes)
    rows = turn_lengths(spec, side_by_side.VOCAB)
    new_tokens = sum(row[0][0] - spec.system_tokens for row in rows) + sum(
        p - prev_p - prev_o for row in rows for (prev_p, prev_o), (p, _) in zip(row, row[1:]))
    assert computed == spec.system_tokens + new_tokens + 64 * 7


def test_w1_to_w3_share_nothing():
    assert all(c == 0 for c, _, _ in side_by_side.request_sizes("W1"))
    assert side_by_side.floor_seconds("W4", 790e12, 4.2e12) > 0
